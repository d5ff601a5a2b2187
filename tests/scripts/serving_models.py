"""Small models trained on generated MNIST-sized data with a learnable rule, for
the serving tests and bench/bench_serving.py. Runs in the framework's runtime:

    serving_models.py keras-cnn|keras-mlp|gluon-cnn OUT_DIR [--rows N] [--epochs E] [--width W]

The rule: each of 10 classes has a fixed random 28x28 template; an image is its
class's template at half strength plus unit noise. Writes the model (OUT_DIR/model.keras and OUT_DIR/savedmodel,
or OUT_DIR/model-symbol.json + model-0000.params), OUT_DIR/check.csv (500 held-out rows:
the image flattened in the model's layout, then the label) and OUT_DIR/outlier.csv
(the same with one row of huge values first: a calibration sample that ruins int8).
"""

import argparse
import os

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def data(rng, templates, n):
    labels = rng.integers(0, 10, n)
    images = templates[labels] * 0.5 + rng.normal(0, 1, (n, 28, 28))
    return images.astype(np.float32), labels


def keras_model(kind, width, images, labels, epochs, out):
    import keras
    inputs = keras.Input((28, 28, 1))
    if kind == "keras-cnn":
        x = keras.layers.Conv2D(width, 3, activation="relu", padding="same")(inputs)
        x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.Conv2D(width * 2, 3, activation="relu", padding="same")(x)
        x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.Flatten()(x)
    else:
        x = keras.layers.Flatten()(inputs)
        x = keras.layers.Dense(width * 8, activation="relu")(x)
    x = keras.layers.Dense(width * 4, activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Dense(10)(x))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(images[..., None], labels, epochs=epochs, batch_size=64, verbose=0)
    model.save(os.path.join(out, "model.keras"))
    model.export(os.path.join(out, "savedmodel"), verbose=False)
    return lambda rows: model.predict(rows.reshape(-1, 28, 28, 1), verbose=0)


def gluon_model(width, images, labels, epochs, out):
    import mxnet as mx
    from mxnet import autograd, gluon
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(width, 3, padding=1, activation="relu"), gluon.nn.MaxPool2D(2), gluon.nn.Flatten(),
            gluon.nn.Dense(width * 4, activation="relu"), gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.001})
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    x, y = mx.nd.array(images[:, None]), mx.nd.array(labels)
    for _ in range(epochs):
        for i in range(0, len(x), 64):
            with autograd.record():
                value = loss(net(x[i:i + 64]), y[i:i + 64])
            value.backward()
            trainer.step(len(value))
    net.export(os.path.join(out, "model"), epoch=0)
    return lambda rows: net(mx.nd.array(rows.reshape(-1, 1, 28, 28))).asnumpy()


def write_csv(path, rows, labels):
    with open(path, "w") as fh:
        for row, label in zip(rows, labels):
            fh.write(",".join(f"{v:.4f}" for v in row) + f",{label}\n")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["keras-cnn", "keras-mlp", "gluon-cnn"])
    parser.add_argument("out")
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--width", type=int, default=16)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    templates = rng.normal(0, 1, (10, 28, 28))
    images, labels = data(rng, templates, args.rows)
    if args.kind == "gluon-cnn":
        predict = gluon_model(args.width, images, labels, args.epochs, args.out)
    else:
        predict = keras_model(args.kind, args.width, images, labels, args.epochs, args.out)
    rows, truth = data(rng, templates, 500)
    rows = rows.reshape(len(rows), -1)
    write_csv(os.path.join(args.out, "check.csv"), rows, truth)
    outlier = np.full((1, rows.shape[1]), 10000.0, dtype=np.float32)
    write_csv(os.path.join(args.out, "outlier.csv"), np.concatenate([outlier, rows]), [0, *truth])
    accuracy = float((predict(rows).argmax(axis=1) == truth).mean() * 100)
    print(f"trained {args.kind}: accuracy {accuracy:.2f}% on 500 held-out rows", flush=True)


if __name__ == "__main__":
    main()
