"""A single-worker Keras script: no -Dcluster, one worker.

    pai -name tensorflow -Dscript=file://$PWD/examples/tensorflow/keras_single_worker.py \
        -DuserDefinedParameters='--epochs 5'

Keras prints `... - loss: 0.1234` at the end of every epoch; paicli turns those into
loss metrics (`pai status ID --json`). Synthetic data (two interleaved noisy
half-moons made here), so nothing is downloaded; the loss visibly falls.
"""

import argparse

import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch_size", type=int, default=64)
parser.add_argument("--samples", type=int, default=2048)
args = parser.parse_args()

rng = np.random.default_rng(7)
angle = rng.uniform(0, np.pi, args.samples)
label = rng.integers(0, 2, args.samples)
x = np.stack([np.cos(angle) + label, np.sin(angle) * (1 - 2 * label) + 0.5 * label], axis=1)
x = (x + 0.1 * rng.normal(size=x.shape)).astype(np.float32)
y = label.astype(np.float32)

model = tf.keras.Sequential([
    tf.keras.Input(shape=(2,)),
    tf.keras.layers.Dense(16, activation="relu"),
    tf.keras.layers.Dense(16, activation="relu"),
    tf.keras.layers.Dense(1, activation="sigmoid"),
])
model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="binary_crossentropy",
              metrics=["accuracy"])
# verbose=2: one line per epoch; a progress bar would redraw itself into the log.
history = model.fit(x, y, epochs=args.epochs, batch_size=args.batch_size, verbose=2)
first, last = history.history["loss"][0], history.history["loss"][-1]
print(f"loss went from {first:.4f} to {last:.4f} in {args.epochs} epochs", flush=True)
