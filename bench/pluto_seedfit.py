"""The seed's hybrid-parallelism table (Pluto slides, AlexNet-like model on 1-8 GPUs,
M40 and K40), against the cost model's compute + bytes/bandwidth terms.

The model for one step with n GPUs sharing a fixed global batch is

    T(n) = T(1) / n + D(n) / B

where D(n) is the data the slide says is exchanged per step (MiB) and B the one
unknown: an effective bandwidth. It is fitted (least squares on 1/B) on ONE column
of the table (both strategies at that GPU count) and every other cell is predicted.

    .venv/bin/python bench/pluto_seedfit.py          # the markdown table in docs/pluto.md
"""

from __future__ import annotations

GPUS = (1, 2, 4, 8)
DATA_MIB = {"data-parallel": (0, 930, 1861, 3722), "hybrid-parallel": (0, 54, 89, 161)}
# Seconds per step, as published: (T_fake, T_real) per strategy per GPU count.
PUBLISHED = {
    "M40": {"data-parallel": {"fake": (2.297, 2.906, 3.672, 5.466), "real": (2.615, 2.861, 3.574, 5.882)},
            "hybrid-parallel": {"fake": (2.297, 1.238, 0.662, 0.443), "real": (2.615, 1.500, 0.831, 0.552)}},
    "K40": {"data-parallel": {"fake": (2.95, 3.517, 5.737, 7.169), "real": (3.487, 8.956, 9.906, 7.407)},
            "hybrid-parallel": {"fake": (2.95, 1.615, 0.957, 0.681), "real": (3.487, 2.304, 1.329, 0.776)}},
}
FIT_GPUS = 4   # the column the bandwidth is fitted on


def fit_bandwidth(card: str, kind: str, column: int = FIT_GPUS) -> float:
    """B (MiB/s) that best explains both strategies' times at `column` GPUs."""
    i = GPUS.index(column)
    num = den = 0.0
    for strategy, data in DATA_MIB.items():
        times = PUBLISHED[card][strategy][kind]
        y = times[i] - times[0] / column
        num += data[i] * y
        den += data[i] ** 2
    return den / num if num > 0 else float("inf")


def predict(card: str, kind: str, strategy: str, bandwidth: float) -> list[float]:
    t1 = PUBLISHED[card][strategy][kind][0]
    return [t1 / n + d / bandwidth for n, d in zip(GPUS, DATA_MIB[strategy])]


def table(column: int = FIT_GPUS) -> list[dict]:
    rows = []
    for card in PUBLISHED:
        for kind in ("fake", "real"):
            bandwidth = fit_bandwidth(card, kind, column)
            for strategy in DATA_MIB:
                published = PUBLISHED[card][strategy][kind]
                predicted = predict(card, kind, strategy, bandwidth)
                rows.append({"card": card, "kind": kind, "strategy": strategy, "bandwidth": bandwidth,
                             "published": published, "predicted": predicted,
                             "errors": [(p - t) / t for p, t in zip(predicted, published)]})
    return rows


def markdown(column: int = FIT_GPUS) -> str:
    lines = [f"| card | data | strategy | B fitted on {column} GPUs | " +
             " | ".join(f"{n} GPU{'s' if n > 1 else ''}: published / predicted" for n in GPUS) + " |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in GPUS) + " |"]
    for row in table(column):
        cells = []
        for n, pub, pred, err in zip(GPUS, row["published"], row["predicted"], row["errors"]):
            if n == 1:
                cells.append(f"{pub:.3f} (the compute term)")
            elif n == column:
                cells.append(f"{pub:.3f} / {pred:.3f} (fitted)")
            else:
                cells.append(f"{pub:.3f} / {pred:.3f} ({err:+.0%})")
        lines.append(f"| {row['card']} | T_{row['kind']} | {row['strategy']} | {row['bandwidth']:.0f} MiB/s | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def predicted_errors(column: int = FIT_GPUS) -> list[float]:
    """|error| of every predicted (not fitted, not 1-GPU) cell."""
    out = []
    for row in table(column):
        for n, err in zip(GPUS, row["errors"]):
            if n not in (1, column):
                out.append(abs(err))
    return out


if __name__ == "__main__":
    import statistics

    print(markdown(), end="")
    errors = predicted_errors()
    print(f"\nmedian |error| of the {len(errors)} predicted cells: {statistics.median(errors):.0%}")
