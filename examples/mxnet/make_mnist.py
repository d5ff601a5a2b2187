"""Writes small MNIST-format files (idx3/idx1, gzipped) of synthetic digits, for
scripts that read MNIST from ./data, such as MXNet's example/image-classification/
train_mnist.py. Our own data, not MNIST: each class is a fixed 28x28 pattern of
strokes, every image that pattern shifted by a pixel or two, with noise, so a
small net learns it within an epoch.

    python examples/mxnet/make_mnist.py DIR [--train 6000] [--test 1000] [--seed 0]

writes DIR/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz. Standard library only.
"""

from __future__ import annotations

import argparse
import gzip
import os
import random
import struct

SIDE = 28
CLASSES = 10
FILES = {"train": "train", "test": "t10k"}


def class_patterns(rng: random.Random) -> list[list[int]]:
    """One 28x28 binary pattern per class: a few random horizontal and vertical strokes."""
    patterns = []
    for _ in range(CLASSES):
        image = [0] * (SIDE * SIDE)
        for _ in range(4):
            fixed, start = rng.randrange(6, 22), rng.randrange(4, 12)
            length = rng.randrange(8, 16)
            vertical = rng.random() < 0.5
            for k in range(start, min(SIDE - 4, start + length)):
                for width in (0, 1):
                    row, col = (k, fixed + width) if vertical else (fixed + width, k)
                    image[row * SIDE + col] = 1
        patterns.append(image)
    return patterns


def sample(pattern: list[int], rng: random.Random) -> bytes:
    dx, dy = rng.randint(-3, 3), rng.randint(-3, 3)
    out = bytearray(SIDE * SIDE)
    for row in range(SIDE):
        for col in range(SIDE):
            r, c = row - dy, col - dx
            on = 0 <= r < SIDE and 0 <= c < SIDE and pattern[r * SIDE + c]
            value = (220 if on else 0) + rng.randint(-40, 35)
            out[row * SIDE + col] = max(0, min(255, value))
    return bytes(out)


def write_set(folder: str, prefix: str, count: int, patterns: list[list[int]], rng: random.Random) -> None:
    labels = bytes(rng.randrange(CLASSES) for _ in range(count))
    with gzip.open(os.path.join(folder, f"{prefix}-labels-idx1-ubyte.gz"), "wb") as f:
        f.write(struct.pack(">II", 2049, count) + labels)
    with gzip.open(os.path.join(folder, f"{prefix}-images-idx3-ubyte.gz"), "wb") as f:
        f.write(struct.pack(">IIII", 2051, count, SIDE, SIDE))
        for label in labels:
            f.write(sample(patterns[label], rng))


def make(folder: str, train: int = 6000, test: int = 1000, seed: int = 0) -> None:
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(seed)
    patterns = class_patterns(rng)
    for name, count in (("train", train), ("test", test)):
        write_set(folder, FILES[name], count, patterns, rng)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--train", type=int, default=6000)
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    make(args.folder, args.train, args.test, args.seed)


if __name__ == "__main__":
    main()
