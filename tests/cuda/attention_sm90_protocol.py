#!/usr/bin/env python3
"""A model of the barrier protocol of kernels/cuda/attention_sm90.cu, run under random
interleavings (no GPU needed).

The kernel cannot be stepped through on the CPU, but its synchronisation can: this script
replays, step for step, what the producer thread and the two consumer warpgroups do with the
mbarriers (q_full[2], k_full[2], v_full[2], k_empty[2], v_empty[2], turn[2]) -- the K/V ring of
two stages counted over both query tiles of a block, the skip path of a warpgroup without rows
below T, the ping-pong turns -- with each TMA copy landing at a random later moment. A barrier
is modelled as the PTX ISA describes it: a phase completes when its pending arrivals reach zero
and its transaction bytes are in; try_wait.parity(P) passes once the phase of parity P has
completed, i.e. when the number of completions has the other parity.

Checked for every T, block and many interleavings: nothing deadlocks, every consumer reads the
tile it expects from a stage, and no copy lands in a stage a warpgroup is reading. The model
also checks that it can fail: two deliberately broken protocols must be caught.
Keep it in step with the kernel when its protocol changes (the function names match).
"""
import random
import sys

ROWS = KEYS = 128  # queries per query tile, keys per K/V tile


class Barrier:
    def __init__(self, name, arrivals):
        self.name, self.arrivals = name, arrivals
        self.pending, self.tx, self.completions = arrivals, 0, 0

    def _complete_if_done(self):
        if self.pending == 0 and self.tx == 0:
            self.completions += 1
            self.pending = self.arrivals

    def arrive(self, n=1, expect_bytes=0):
        self.tx += expect_bytes
        self.pending -= n
        if self.pending < 0:
            raise AssertionError(f"{self.name}: more arrivals than the phase expects")
        self._complete_if_done()

    def complete_tx(self, nbytes):
        self.tx -= nbytes
        self._complete_if_done()

    def passed(self, parity):
        return (self.completions & 1) != parity


def tiles_of(q_tile, T):
    return (min((q_tile + 1) * ROWS, T) - 1) // KEYS + 1


def simulate(T, block_x, seed, pingpong=True, broken=None):
    """Runs one block; returns "ok" or what went wrong."""
    rng = random.Random(seed)
    nq = (T - 1) // ROWS + 1
    long_tile, short_tile = nq - 1 - block_x, block_x
    n_items = 2 if short_tile < long_tile else 1

    def item(j):  # ForwardBlock::item: (q0, n_tiles, first_it)
        q_tile = long_tile if j == 0 else short_tile
        return q_tile * ROWS, tiles_of(q_tile, T), 0 if j == 0 else tiles_of(long_tile, T)

    q_full = [Barrier(f"q_full[{j}]", 1) for j in range(2)]
    k_full = [Barrier(f"k_full[{s}]", 1) for s in range(2)]
    v_full = [Barrier(f"v_full[{s}]", 1) for s in range(2)]
    k_empty = [Barrier(f"k_empty[{s}]", 8) for s in range(2)]
    v_empty = [Barrier(f"v_empty[{s}]", 8) for s in range(2)]
    turn = [Barrier(f"turn[{c}]", 4) for c in range(2)]
    stage_holds = {(kind, s): None for kind in "kv" for s in range(2)}
    readers = {key: set() for key in stage_holds}
    copies_in_flight = []
    errors = []
    BYTES = 100

    def tma(kind, stage, tile, bar):
        copies_in_flight.append((kind, stage, tile, bar))

    def produce_kv_tile(it):
        stage, use = it % 2, it // 2
        if use > 0:
            yield ("wait", k_empty[stage], (use - 1) & 1)
        k_full[stage].arrive(1, BYTES)
        tma("k", stage, it, k_full[stage])
        if use > 0 and broken != "no v_empty wait":
            yield ("wait", v_empty[stage], (use - 1) & 1)
        v_full[stage].arrive(1, BYTES)
        tma("v", stage, it, v_full[stage])
        yield ("step",)

    def produce_tiles():
        for j in range(n_items):
            q0, n, first_it = item(j)
            q_full[j].arrive(1, BYTES)
            tma("q", j, j, q_full[j])
            for t in range(n):
                yield from produce_kv_tile(first_it + t)

    def consume(c):
        turns = 0
        for j in range(n_items):
            q0, n, first_it = item(j)
            row0 = q0 + 64 * c
            first = max(0, n - 1 - (row0 + 63) // KEYS) if row0 < T else n
            pp = pingpong and q0 + 64 < T

            def stage(it):
                return (first_it + it) % 2

            def parity(it):
                return ((first_it + it) // 2) & 1

            def begin_read(kind, it):
                key = (kind, stage(it))
                if stage_holds[key] != first_it + it:
                    errors.append(f"warpgroup {c} reads {kind} tile {first_it + it} from stage "
                                  f"{stage(it)}, which holds tile {stage_holds[key]}")
                readers[key].add(c)

            def end_read(kind, it):
                readers[(kind, stage(it))].discard(c)

            def await_turn():
                nonlocal turns
                if not pp:
                    return ("step",)
                parity_ = turns & 1
                turns += 1
                return ("wait", turn[c], parity_)

            def pass_turn(last_issue=False):
                skip_last = broken != "wg1 passes after its last issue"
                if pp and not (skip_last and last_issue and c == 1):
                    turn[1 - c].arrive(4)

            if pp and c == 1:
                pass_turn()
            yield ("wait", q_full[j], 0)
            for it in range(first):  # tiles entirely in the future: released unread
                yield ("wait", k_full[stage(it)], parity(it))
                yield ("wait", v_full[stage(it)], parity(it))
                k_empty[stage(it)].arrive(4)
                v_empty[stage(it)].arrive(4)
            if first == n:
                continue
            # first_tile
            it = first
            yield ("wait", k_full[stage(it)], parity(it))
            yield await_turn()
            begin_read("k", it)
            pass_turn()
            yield ("step",)
            end_read("k", it)
            k_empty[stage(it)].arrive(4)
            # next_tile
            for it in range(first + 1, n):
                prev = it - 1
                yield ("wait", k_full[stage(it)], parity(it))
                yield ("wait", v_full[stage(prev)], parity(prev))
                yield await_turn()
                begin_read("k", it)
                begin_read("v", prev)
                pass_turn()
                yield ("step",)
                end_read("k", it)
                k_empty[stage(it)].arrive(4)
                yield ("step",)
                end_read("v", prev)
                v_empty[stage(prev)].arrive(4)
            # last_pv
            it = n - 1
            yield ("wait", v_full[stage(it)], parity(it))
            yield await_turn()
            begin_read("v", it)
            pass_turn(last_issue=True)
            yield ("step",)
            end_read("v", it)
            v_empty[stage(it)].arrive(4)
            yield ("step",)  # store_rows

    agents = {"producer": produce_tiles(), "consumer 0": consume(0), "consumer 1": consume(1)}
    waiting = {name: None for name in agents}
    finished = set()
    for _ in range(1_000_000):
        if len(finished) == len(agents) and not copies_in_flight:
            break
        runnable = [name for name in agents if name not in finished and
                    (waiting[name] is None or waiting[name][0] == "step" or
                     waiting[name][1].passed(waiting[name][2]))]
        choices = runnable + (["copy"] if copies_in_flight else [])
        if not choices:
            stuck = {name: waiting[name][1].name for name in agents if name not in finished}
            return f"deadlock: {stuck}"
        pick = rng.choice(choices)
        if pick == "copy":
            kind, stage, tile, bar = copies_in_flight.pop(rng.randrange(len(copies_in_flight)))
            if kind != "q":
                if readers[(kind, stage)]:
                    errors.append(f"a copy of {kind} tile {tile} lands in stage {stage} while "
                                  f"warpgroup(s) {readers[(kind, stage)]} read it")
                stage_holds[(kind, stage)] = tile
            bar.complete_tx(BYTES)
            continue
        try:
            waiting[pick] = next(agents[pick])
        except StopIteration:
            finished.add(pick)
    else:
        return "no progress"
    return errors[0] if errors else "ok"


def check_all(broken=None, seeds=40):
    """Returns the failures over all shapes and blocks ([] when the protocol holds)."""
    failures = []
    for T in [1, 17, 64, 65, 128, 129, 192, 200, 256, 300, 1024, 1061, 2000]:
        nq = (T - 1) // ROWS + 1
        for block_x in range((nq + 1) // 2):
            for pingpong in (True, False):
                for seed in range(seeds):
                    result = simulate(T, block_x, seed * 7919 + block_x, pingpong, broken)
                    if result != "ok":
                        failures.append(f"T={T} block {block_x} pingpong={pingpong} "
                                        f"seed {seed}: {result}")
                        break
    return failures


def main():
    failures = check_all()
    for f in failures:
        print("FAIL", f)
    # The model must be able to fail: broken protocols have to be caught.
    for broken in ["no v_empty wait", "wg1 passes after its last issue"]:
        caught = check_all(broken, seeds=10)
        print(f"broken protocol '{broken}': {'caught' if caught else 'NOT caught'}"
              + (f" ({caught[0]})" if caught else ""))
        if not caught:
            failures.append(f"the model did not catch '{broken}'")
    print("protocol model:", "ok" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
