#!/usr/bin/env python3
"""A model of the barrier protocol of kernels/cuda/attention_sm90.cu, run under random
interleavings (no GPU needed).

The kernel cannot be stepped through on the CPU, but its synchronisation can: this script
replays, step for step, what the producer thread and the two consumer warpgroups of one block do
with the mbarriers (q_full[2], q_empty[2], k_full[2], v_full[2], k_empty[2], v_empty[2],
turn[2]) -- the persistent walk over units (TileCursor: units block, block + grid, ...), the two
Q buffers taken in turn by the block's query tiles, the K and V rings of two or three stages
(Sm90Forward::kKStages, kVStages) counted over all of them, K loaded one tile ahead of V or
together with it (kValueLag), the skip path of a
warpgroup without rows below T, the ping-pong turns running on over the query tiles (the
tensor cores must see the warpgroups' issues alternate) -- with each TMA copy landing at a random
later moment. A barrier is modelled as the PTX ISA describes it: a phase completes when its
pending arrivals reach zero and its transaction bytes are in; try_wait.parity(P) passes once the
phase of parity P has completed, i.e. when the number of completions has the other parity.

Checked for every shape, block and many interleavings: nothing deadlocks, no phase gets more
arrivals than it expects, every consumer reads the tile it expects from a stage or Q buffer, and
no copy lands in a stage or Q buffer a warpgroup is reading. The model also checks that it can
fail: six deliberately broken protocols must be caught.
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


def block_items(T, heads, grid, block):
    """TileCursor: the query tiles block `block` of `grid` walks over, as (j, q0, n_tiles,
    first_it): units block, block + grid, ... of heads * ceil(nq / 2), each its long query tile
    nq - 1 - x and then its short one x (the middle tile of an odd nq alone)."""
    nq = (T - 1) // ROWS + 1
    units_per_head = (nq + 1) // 2
    items, ring = [], 0
    for unit in range(block, heads * units_per_head, grid):
        x = unit % units_per_head
        for q_tile in ([nq - 1 - x, x] if x < nq - 1 - x else [nq - 1 - x]):
            n_tiles = q_tile + 1  # the causal tiles of query tile q_tile, whatever T
            assert n_tiles == (min((q_tile + 1) * ROWS, T) - 1) // KEYS + 1
            items.append((len(items), q_tile * ROWS, n_tiles, ring))
            ring += n_tiles
    return items


def simulate(T, heads, grid, block, seed, pingpong=True, keys_ahead=True, k_stages=2,
             v_stages=2, broken=None):
    """Runs one block of a grid of `grid` blocks over `heads` (batch, head) pairs; returns "ok"
    or what went wrong."""
    rng = random.Random(seed)
    items = block_items(T, heads, grid, block)

    q_full = [Barrier(f"q_full[{b}]", 1) for b in range(2)]
    q_empty = [Barrier(f"q_empty[{b}]", 8) for b in range(2)]
    stages = {"k": k_stages, "v": v_stages}  # Sm90Forward::kKStages, kVStages
    k_full = [Barrier(f"k_full[{s}]", 1) for s in range(k_stages)]
    v_full = [Barrier(f"v_full[{s}]", 1) for s in range(v_stages)]
    k_empty = [Barrier(f"k_empty[{s}]", 8) for s in range(k_stages)]
    v_empty = [Barrier(f"v_empty[{s}]", 8) for s in range(v_stages)]
    turn = [Barrier(f"turn[{c}]", 4) for c in range(2)]
    last_issuer = [1]  # warpgroup 0 issues first
    stage_holds = {(kind, s): None for kind in "qkv" for s in range(stages.get(kind, 2))}
    readers = {key: set() for key in stage_holds}
    copies_in_flight = []
    errors = []
    BYTES = 100

    def tma(kind, stage, tile, bar):
        copies_in_flight.append((kind, stage, tile, bar))

    def produce_kv(kind, it):
        stage, use = it % stages[kind], it // stages[kind]
        full, empty = (k_full, k_empty) if kind == "k" else (v_full, v_empty)
        if use > 0 and not (kind == "v" and broken == "no v_empty wait"):
            yield ("wait", empty[stage], (use - 1) & 1)
        full[stage].arrive(1, BYTES)
        tma(kind, stage, it, full[stage])
        yield ("step",)

    def produce_tiles():
        # Sm90Forward::kValueLag: V tile t - lag after K tile t
        lag = 1 if keys_ahead and v_stages == k_stages else 0
        for j, q0, n, first_it in items:
            buffer = j % 2
            if j >= 2 and broken != "no q_empty wait":
                yield ("wait", q_empty[buffer], (j // 2 - 1) & 1)
            q_full[buffer].arrive(1, BYTES)
            tma("q", buffer, j, q_full[buffer])
            for t in range(n + lag):
                if t < n:
                    yield from produce_kv("k", first_it + t)
                if t >= lag:
                    yield from produce_kv("v", first_it + t - lag)

    def consume(c):
        turns = 0
        if c == 1 and pingpong:  # once per block, so that warpgroup 0 issues first
            turn[0].arrive(4)
        for j, q0, n, first_it in items:
            row0 = q0 + 64 * c
            first = max(0, n - 1 - (row0 + 63) // KEYS) if row0 < T else n
            pp = pingpong and q0 + 64 < T
            buffer = j % 2

            def ring(kind):
                if broken == "consumers count 2 V stages" and kind == "v":
                    return 2
                return stages[kind]

            def stage(it, kind="k"):
                return (first_it + it) % ring(kind)

            def parity(it, kind="k"):
                return ((first_it + it) // ring(kind)) & 1

            def begin_read(kind, it):
                key = (kind, stage(it, kind))
                if stage_holds[key] != first_it + it:
                    errors.append(f"warpgroup {c} reads {kind} tile {first_it + it} from stage "
                                  f"{stage(it, kind)}, which holds tile {stage_holds[key]}")
                readers[key].add(c)

            def end_read(kind, it):
                readers[(kind, stage(it, kind))].discard(c)

            def read_q():  # an S MMA reads this query tile's Q
                if stage_holds[("q", buffer)] != j:
                    errors.append(f"warpgroup {c} reads Q of query tile {j} from buffer {buffer}, "
                                  f"which holds query tile {stage_holds[('q', buffer)]}")
                readers[("q", buffer)].add(c)

            def await_turn():
                nonlocal turns
                if not pp:
                    return ("step",)
                parity_ = turns & 1
                turns += 1
                return ("wait", turn[c], parity_)

            def pass_turn(last_issue=False):
                if pp and not (broken == "wg0 keeps its last turn" and last_issue and c == 0):
                    turn[1 - c].arrive(4)
                if pp:  # the tensor cores alternate between the warpgroups
                    if last_issuer[0] == c:
                        errors.append(f"warpgroup {c} issued twice in a row under ping-pong")
                    last_issuer[0] = c

            def release_q():
                readers[("q", buffer)].discard(c)
                q_empty[buffer].arrive(4)

            if pp and c == 1 and broken == "wg1 arrives at every query tile's start":
                turn[0].arrive(4)
            q_parity = 0 if broken == "q_full parity 0" else (j // 2) & 1
            yield ("wait", q_full[buffer], q_parity)
            for it in range(first):  # tiles entirely in the future: released unread
                yield ("wait", k_full[stage(it)], parity(it))
                yield ("wait", v_full[stage(it, "v")], parity(it, "v"))
                k_empty[stage(it)].arrive(4)
                v_empty[stage(it, "v")].arrive(4)
            if first == n:
                release_q()
                continue
            # first_tile
            it = first
            yield ("wait", k_full[stage(it)], parity(it))
            yield await_turn()
            read_q()
            begin_read("k", it)
            pass_turn()
            yield ("step",)
            end_read("k", it)
            k_empty[stage(it)].arrive(4)
            # next_tile
            for it in range(first + 1, n):
                prev = it - 1
                yield ("wait", k_full[stage(it)], parity(it))
                yield ("wait", v_full[stage(prev, "v")], parity(prev, "v"))
                yield await_turn()
                read_q()
                begin_read("k", it)
                begin_read("v", prev)
                pass_turn()
                yield ("step",)
                end_read("k", it)
                k_empty[stage(it)].arrive(4)
                yield ("step",)
                end_read("v", prev)
                v_empty[stage(prev, "v")].arrive(4)
            # last_pv
            it = n - 1
            yield ("wait", v_full[stage(it, "v")], parity(it, "v"))
            yield await_turn()
            begin_read("v", it)
            pass_turn(last_issue=True)
            yield ("step",)
            end_read("v", it)
            v_empty[stage(it, "v")].arrive(4)
            release_q()
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
        except AssertionError as e:  # an arrival the phase does not expect
            return str(e)
    else:
        return "no progress"
    return errors[0] if errors else "ok"


# (T, heads, grid): one block per unit (the grid without kPersistentGrid), and persistent grids
# smaller than the unit count so that blocks walk over several units, heads and ring wraps --
# including a grid of one block and counts that do not divide the units.
SHAPES = [(T, 1, None) for T in [1, 17, 64, 65, 128, 129, 192, 200, 256, 300, 1024, 1061, 2000]]
SHAPES += [(1, 7, 3), (17, 5, 2), (100, 6, 4), (128, 4, 3), (129, 3, 2), (200, 5, 3),
           (300, 4, 5), (385, 3, 2), (1024, 3, 5), (1061, 2, 3), (640, 6, 1)]


# (ping-pong, kKeysAhead, kKStages, kVStages): D = 64 and D = 128 as built, each also without
# ping-pong (a query tile whose second warpgroup has no rows), and the first-measured rings.
VARIANTS = [(True, True, 3, 3), (True, True, 2, 3), (False, True, 3, 3), (False, True, 2, 3),
            (True, True, 2, 2), (True, False, 2, 2)]


def check_all(broken=None, seeds=30):
    """Returns the failures over all shapes and blocks ([] when the protocol holds)."""
    failures = []
    for T, heads, grid in SHAPES:
        units = heads * (((T - 1) // ROWS + 2) // 2)
        grid = grid or units
        for block in range(min(grid, units)):
            for pingpong, keys_ahead, k_stages, v_stages in VARIANTS:
                for seed in range(seeds):
                    result = simulate(T, heads, grid, block, seed * 7919 + block, pingpong,
                                      keys_ahead, k_stages, v_stages, broken)
                    if result != "ok":
                        failures.append(f"T={T} heads {heads} grid {grid} block {block} "
                                        f"pingpong={pingpong} keys_ahead={keys_ahead} "
                                        f"stages={k_stages}/{v_stages} seed {seed}: {result}")
                        break
    return failures


def main():
    failures = check_all()
    for f in failures:
        print("FAIL", f)
    # The model must be able to fail: broken protocols have to be caught.
    for broken in ["no v_empty wait", "wg0 keeps its last turn",
                   "wg1 arrives at every query tile's start", "no q_empty wait", "q_full parity 0",
                   "consumers count 2 V stages"]:
        caught = check_all(broken, seeds=10)
        print(f"broken protocol '{broken}': {'caught' if caught else 'NOT caught'}"
              + (f" ({caught[0]})" if caught else ""))
        if not caught:
            failures.append(f"the model did not catch '{broken}'")
    print("protocol model:", "ok" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
