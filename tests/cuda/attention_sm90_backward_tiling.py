#!/usr/bin/env python3
"""A model of the tiling and pipeline of kernels/cuda/attention_sm90_backward.cu (no GPU needed).

The kernels cannot be stepped through on the CPU, but their index arithmetic and barrier use can:
this script replays BackwardBlock::make, the per-warpgroup skip and mask decisions and the
2-stage TMA ring of both kernels (dk/dv and dq) for every T up to a few tiles, both head sizes and
GQA groups 1-4, and checks that:
  - every causal (key, query) pair of every head below T is computed exactly once in each kernel,
    by the warpgroup that owns the row (dk/dv: the key, dq: the query), with the pair's query head
    and key/value head;
  - a tile computed without the mask holds only visible pairs below T (so skipping the mask
    there is exact), and every pair outside the causal triangle or past T that is computed is
    masked;
  - the ring: step i waits for parity (i // 2) & 1 of col_full[i % 2]; with a copy landing at a
    random later moment, the wait passes only once step i's copy (and no later one) is in, and no
    copy is issued into a stage whose previous copy has not landed and been read.
The model also checks that it can fail: deliberately broken variants must be caught.
Keep it in step with the kernel when its tiling changes (the names match).
"""
import random
import sys

ROWS = 128  # a block's fixed rows: 2 warpgroups of 64


def cols_of(D):
    return 128 if D == 64 else 64


def make_block(dkv, D, T, H, group, bx, by, grid_x, broken=None):
    """BackwardBlock::make."""
    C = cols_of(D)
    col_tiles = (T + C - 1) // C
    blk = {}
    if dkv:
        H_kv = H // group
        blk["b"], blk["row_head"] = by // H_kv, by % H_kv
        blk["row0"] = bx * ROWS
        blk["col_head0"] = blk["row_head"] * group
        blk["first_col_tile"] = blk["row0"] // C
        if broken == "first_col_tile":
            blk["first_col_tile"] += 1
        blk["per_head"] = col_tiles - blk["first_col_tile"]
        blk["steps"] = group * blk["per_head"]
    else:
        blk["b"], blk["row_head"] = by // H, by % H
        blk["row0"] = (grid_x - 1 - bx) * ROWS
        blk["col_head0"] = blk["row_head"] // group
        blk["first_col_tile"] = 0
        blk["per_head"] = (min(blk["row0"] + ROWS, T) - 1) // C + 1
        blk["steps"] = blk["per_head"]
    return blk


def col_head(blk, i):
    return blk["col_head0"] + i // blk["per_head"]


def col0(blk, i, C):
    return (blk["first_col_tile"] + i % blk["per_head"]) * C


def run_tiling(dkv, D, T, H, group, broken=None):
    """Returns the problems found (empty when none)."""
    C = cols_of(D)
    grid_x = (T + ROWS - 1) // ROWS
    grid_y = 1 * (H // group if dkv else H)  # B = 1: the batch index is plain division
    seen = {}
    problems = []
    for by in range(grid_y):
        for bx in range(grid_x):
            blk = make_block(dkv, D, T, H, group, bx, by, grid_x, broken)
            if blk["steps"] < 1:
                problems.append(f"block {bx} has no steps")
                continue
            for wg in range(2):
                wg_row0 = blk["row0"] + 64 * wg
                if wg_row0 >= T:  # not active
                    continue
                for i in range(blk["steps"]):
                    c0 = col0(blk, i, C)
                    if c0 >= T:
                        problems.append(f"block {bx} step {i}: a column tile starting past T")
                        continue
                    if dkv:
                        skip = c0 + C - 1 < wg_row0
                        mask = c0 < wg_row0 + 63 or c0 + C > T
                    else:
                        skip = c0 > wg_row0 + 63
                        mask = c0 + C - 1 > wg_row0 or c0 + C > T
                    if broken == "mask":
                        mask = c0 + C > T
                    if skip:
                        continue
                    # dkv: rows keys of head row_head (kv), columns queries of col_head (query);
                    # dq: rows queries of row_head, columns keys of col_head (kv).
                    for r in range(wg_row0, wg_row0 + 64):
                        if r >= T:
                            continue
                        for c in range(c0, c0 + C):
                            key, query = (r, c) if dkv else (c, r)
                            qh, kvh = (col_head(blk, i), blk["row_head"]) if dkv else (
                                blk["row_head"], col_head(blk, i))
                            visible = query >= key and c < T
                            if not visible:
                                if not mask:
                                    problems.append(f"unmasked invisible pair {(key, query)}")
                                continue
                            pair = (qh, kvh, key, query)
                            seen[pair] = seen.get(pair, 0) + 1
    for qh in range(H):
        kvh = qh // group
        for query in range(T):
            for key in range(query + 1):
                n = seen.get((qh, kvh, key, query), 0)
                if n != 1:
                    problems.append(f"pair head {qh} key {key} query {query} computed {n} times")
    if len(seen) != H * T * (T + 1) // 2:
        problems.append("pairs of wrong heads computed")
    return problems


def run_ring(steps, seed, broken=None):
    """The 2-stage ring of one block: thread 0 issues step i + 1's copy at the top of step i (after
    the __syncthreads that ended step i - 1), every thread waits for parity (i // 2) & 1 of
    col_full[i % 2]; copies land at random later moments. Returns a problem or ''."""
    rng = random.Random(seed)
    completions = [0, 0]  # per stage
    in_flight = []  # (stage, step) copies not landed yet
    last_read = [-1, -1]  # the last step that read each stage, once done

    def issue(step):
        stage = step % 2
        if any(s == stage for s, _ in in_flight):
            return f"step {step}: copy into stage {stage} while another is landing"
        if step >= 2 and last_read[stage] != step - 2:
            return f"step {step}: stage {stage} refilled before step {step - 2} read it"
        in_flight.append((stage, step))
        return ""

    def land_some():
        while in_flight and rng.random() < 0.5:
            stage, step = in_flight.pop(0)
            completions[stage] += 1
            if completions[stage] != step // 2 + 1:
                raise AssertionError("copies landed out of order")

    problem = issue(0)
    for i in range(steps):
        if problem:
            return problem
        if i + 1 < steps:
            problem = issue(i + 1) if broken != "late_issue" else issue(min(i + 2, steps - 1))
            if problem:
                return problem
        stage, parity = i % 2, (i // 2) & 1
        if broken == "parity":
            parity = (i // 2 + 1) & 1
        while (completions[stage] & 1) == parity:  # try_wait.parity: not yet
            if not in_flight:
                return f"step {i}: waits forever for parity {parity} of stage {stage}"
            stage_l, step_l = in_flight.pop(0)  # the oldest copy lands
            completions[stage_l] += 1
        if completions[stage] != i // 2 + 1:
            return f"step {i}: read stage {stage} holding copy {completions[stage] - 1}"
        last_read[stage] = i  # the MMAs finished (wait_group 0) before the __syncthreads
        land_some()
    return ""


def main():
    failures = 0
    for D in (64, 128):
        for dkv in (True, False):
            for T in list(range(1, 20)) + list(range(20, 140, 7)) + [63, 64, 65, 127, 128, 129,
                                                                 191, 192, 193, 256, 257, 385]:
                for H, group in ((3, 1), (3, 3), (4, 2), (4, 4)):
                    problems = run_tiling(dkv, D, T, H, group)
                    if problems:
                        failures += 1
                        print(f"D {D} {'dkv' if dkv else 'dq'} T {T} H {H} group {group}: "
                              f"{problems[:3]}")
    for steps in range(1, 40):
        for seed in range(20):
            problem = run_ring(steps, seed)
            if problem:
                failures += 1
                print(f"ring, {steps} steps, seed {seed}: {problem}")
    # The model must be able to fail.
    for broken in ("first_col_tile", "mask"):
        if not any(run_tiling(True, D, 300, 3, 3, broken) for D in (64, 128)):
            failures += 1
            print(f"the broken tiling '{broken}' was not caught")
    for broken in ("parity", "late_issue"):
        if not any(run_ring(s, seed, broken) for s in range(3, 12) for seed in range(10)):
            failures += 1
            print(f"the broken ring '{broken}' was not caught")
    print("attention_sm90_backward_tiling:", "FAILED" if failures else "ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
