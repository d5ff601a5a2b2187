"""Generate the LeNet example's data: 28x28 grey images of 4 kinds of stroke
(horizontal bar, vertical bar, diagonal, box outline) at random places with noise,
as HDF5 in Caffe's N x 1 x 28 x 28 layout.

Run it with any Python that has numpy and h5py, e.g. the Caffe runtime's own
(its folder is the path `pai runtime list` shows for caffe):
    ~/.cache/paicli/runtimes/caffe/paicli-python examples/caffe/lenet/make_data.py
Writes data/train_{0..3}.h5 + data/train.txt and data/test.h5 + data/test.txt
next to this file (list entries are relative to this directory, where the job runs).
"""

import os
import sys

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SIZE, CLASSES, TRAIN_FILES, PER_FILE, TEST = 28, 4, 4, 1024, 512


def draw(rng, kind):
    img = np.zeros((SIZE, SIZE), np.float32)
    a, b = rng.randint(4, SIZE - 12, size=2)
    length = rng.randint(8, 12)
    if kind == 0:
        img[a:a + 2, b:b + length] = 1.0
    elif kind == 1:
        img[a:a + length, b:b + 2] = 1.0
    elif kind == 2:
        for i in range(length):
            img[a + i, b + i] = 1.0
    else:
        img[a, b:b + length] = img[a + length - 1, b:b + length] = 1.0
        img[a:a + length, b] = img[a:a + length, b + length - 1] = 1.0
    img += rng.normal(0.0, 0.15, size=img.shape).astype(np.float32)
    return np.clip(img, 0.0, 1.0)


def make(rng, count):
    labels = rng.randint(0, CLASSES, size=count)
    images = np.stack([draw(rng, k) for k in labels])[:, None, :, :]
    return images.astype(np.float32), labels.astype(np.float32)


def write(path, data, labels):
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=data)
        f.create_dataset("label", data=labels)


def main():
    out = os.path.join(HERE, "data")
    os.makedirs(out, exist_ok=True)
    rng = np.random.RandomState(11)
    names = []
    for i in range(TRAIN_FILES):
        name = f"data/train_{i}.h5"
        write(os.path.join(HERE, name), *make(rng, PER_FILE))
        names.append(name)
    with open(os.path.join(out, "train.txt"), "w") as f:
        f.write("\n".join(names) + "\n")
    write(os.path.join(out, "test.h5"), *make(rng, TEST))
    with open(os.path.join(out, "test.txt"), "w") as f:
        f.write("data/test.h5\n")
    print(f"wrote {TRAIN_FILES * PER_FILE} training and {TEST} test images to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
