"""Generate the MLP example's data: 4 Gaussian clusters in 16 dimensions, as HDF5.

Run it with any Python that has numpy and h5py, e.g. the Caffe runtime's own
(its folder is the path `pai runtime list` shows for caffe):
    ~/.cache/paicli/runtimes/caffe/paicli-python examples/caffe/mlp/make_data.py
Writes data/train_{0..3}.h5 + data/train.txt and data/test.h5 + data/test.txt
next to this file; the lists name the files relative to this directory, which is
where `pai -name caffe` runs the solver (the directory that holds the solver's net).
"""

import os
import sys

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CLASSES, DIM, TRAIN_FILES, PER_FILE, TEST = 4, 16, 4, 512, 512


def make(rng, count, centers):
    labels = rng.randint(0, CLASSES, size=count)
    data = centers[labels] + rng.normal(0.0, 1.0, size=(count, DIM))
    return data.astype(np.float32), labels.astype(np.float32)


def write(path, data, labels):
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=data)
        f.create_dataset("label", data=labels)


def main():
    out = os.path.join(HERE, "data")
    os.makedirs(out, exist_ok=True)
    rng = np.random.RandomState(7)
    centers = rng.normal(0.0, 0.4, size=(CLASSES, DIM))
    names = []
    for i in range(TRAIN_FILES):
        name = f"data/train_{i}.h5"
        write(os.path.join(HERE, name), *make(rng, PER_FILE, centers))
        names.append(name)
    with open(os.path.join(out, "train.txt"), "w") as f:
        f.write("\n".join(names) + "\n")
    write(os.path.join(out, "test.h5"), *make(rng, TEST, centers))
    with open(os.path.join(out, "test.txt"), "w") as f:
        f.write("data/test.h5\n")
    print(f"wrote {TRAIN_FILES * PER_FILE} training and {TEST} test records to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
