"""The int8 pass's two ways of forming the self-products, on both sides of the rule that picks one.

    python bench/int8_blocks.py [--size N,D] [--fractions 0.3,0.5,0.55,0.6,0.8,1] [--threads T] [--device cpu|cuda]
                                [--repeats R] [--json]

The int8 pass prices each token's own row against every stored row. Over most of
the rows it forms the symmetric matrix of products once, in square blocks on and
above the diagonal (integer_pass._symmetric_maxima); over fewer tokens it forms
blocks of tokens times square blocks of rows (integer_pass._tiled_maxima). The rule (integer_pass._symmetric) takes the
symmetric pass where 3 x tokens > 2 x stored rows + the blocks' side. Both give the
same bounds bit for bit (tests/test_integer_pass.py), so the rule is one of speed
only: this bench times both ways for token sets of several fractions of the
vocabulary of bench/families.py's base head, marks the one the rule takes, and
checks that the two gave the same bounds.

For each fraction it prints the best of ``--repeats`` runs of each way, in seconds.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from families import BASE, build

from auditor.engine.arithmetic.head import build_engine_head
from auditor.engine.screen import integer_pass
from auditor.question.domain import parse_domain


def _timed(head, ids, rows, symmetric: bool) -> tuple[float, list]:
    rule = integer_pass._symmetric
    integer_pass._symmetric = (lambda r, c: True) if symmetric else (lambda r, c: False)
    try:
        if head.device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        found = [(part, top.cpu(), rival.cpu()) for part, _, top, rival, _ in integer_pass.self_bounds(head, ids, rows)]
        if head.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started, found
    finally:
        integer_pass._symmetric = rule


def _by_token(found: list) -> tuple[np.ndarray, np.ndarray]:
    parts = np.concatenate([p for p, _, _ in found])
    order = np.argsort(parts)
    return (torch.cat([t for _, t, _ in found]).numpy()[order], torch.cat([r for _, _, r in found]).numpy()[order])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="32768,512")
    parser.add_argument("--fractions", default="0.3,0.5,0.55,0.6,0.8,1")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n, d = (int(x) for x in args.size.split(","))
    W, _, _, _ = build(BASE, n, d, 0)
    head = build_engine_head(torch.from_numpy(W).to(args.device), None, np.arange(n), parse_domain("unbounded"), 1e-10)
    rows = integer_pass.integer_rows(head)
    stored = rows.values.shape[0]
    side = integer_pass._side(head.device)
    print(f"{n} x {d}, {args.device}, {args.threads} threads; blocks of side {side}; "
          f"the rule takes the symmetric pass from {(2 * stored + side) / 3 / n:.3f} of the rows")
    rng = np.random.default_rng(0)
    competitors = torch.nonzero(head.competitor).flatten().cpu().numpy()  # (copies of a row are never tokens here)
    results = []
    for fraction in (float(f) for f in args.fractions.split(",")):
        ids = np.sort(rng.choice(competitors, size=max(1, int(round(fraction * competitors.size))), replace=False))
        plain = min(_timed(head, ids, rows, False)[0] for _ in range(args.repeats))
        symmetric = min(_timed(head, ids, rows, True)[0] for _ in range(args.repeats))
        same = all(np.array_equal(a, b) for a, b in zip(_by_token(_timed(head, ids, rows, False)[1]),
                                                         _by_token(_timed(head, ids, rows, True)[1])))
        taken = "symmetric" if integer_pass._symmetric(rows, ids.size) else "plain"
        print(f"tokens {fraction:5.2f} of the rows: plain {plain:6.2f} s  symmetric {symmetric:6.2f} s  "
              f"rule takes {taken:9s}  same bounds {same}")
        results.append(dict(fraction=fraction, tokens=int(ids.size), plain_s=round(plain, 3),
                            symmetric_s=round(symmetric, 3), taken=taken, same=same))
    if args.json:
        print(json.dumps(dict(size=[n, d], threads=args.threads, device=args.device, results=results)))


if __name__ == "__main__":
    main()
