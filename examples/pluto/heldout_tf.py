"""Held-out TF1 ps/worker scripts for Pluto's error on work it was not fitted to
(bench/bench_pluto.py heldout): --model picks one of two models.

    wide   a wider, shallower MLP than tf_wide_mlp.py: two hidden layers of --width
           units (900: 3.4 MB)
    conv   a small conv net on 3x16x16 synthetic images (two 3x3 convolutions, a
           dense head of --width units)

Between-graph asynchronous training (replica_device_setter, round-robin by default);
the workers run until global_step reaches --steps and print
`step=N, global_step=G, loss=L`. Synthetic data from a fixed teacher.
"""

import argparse
import json
import os
import time

import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", choices=("wide", "conv"), default="wide")
parser.add_argument("--steps", type=int, default=60, help="train until global_step reaches this")
parser.add_argument("--batch_size", type=int, default=32)
parser.add_argument("--learning_rate", type=float, default=0.02)
parser.add_argument("--width", type=int, default=900)
args = parser.parse_args()
FEATURES = 48

tf.compat.v1.disable_eager_execution()
config = json.loads(os.environ.get("TF_CONFIG") or "{}")
cluster = config.get("cluster") or {}
task_type = config.get("task", {}).get("type", "worker")
task_index = int(config.get("task", {}).get("index", 0))

if cluster:
    spec = tf.train.ClusterSpec(cluster)
    server = tf.compat.v1.train.Server(spec, job_name=task_type, task_index=task_index)
    if task_type == "ps":
        server.join()
    target = server.target
    device_fn = tf.compat.v1.train.replica_device_setter(
        worker_device=f"/job:{task_type}/task:{task_index}", cluster=spec)
    session_config = tf.compat.v1.ConfigProto(device_filters=["/job:ps", f"/job:{task_type}/task:{task_index}"])
    is_chief = task_index == 0
else:
    target, device_fn, session_config, is_chief = "", None, None, True

rng = np.random.default_rng(7)
teacher = rng.normal(size=(FEATURES, 1)).astype(np.float32) / np.sqrt(FEATURES)
data_rng = np.random.default_rng(100 + task_index)


def dense(h, n_in, n_out, name, relu=True):
    w = tf.compat.v1.get_variable(f"w_{name}", [n_in, n_out], initializer=tf.compat.v1.glorot_uniform_initializer())
    b = tf.compat.v1.get_variable(f"b_{name}", [n_out], initializer=tf.compat.v1.zeros_initializer())
    h = tf.matmul(h, w) + b
    return tf.nn.relu(h) if relu else h


def conv(h, c_in, c_out, name):
    k = tf.compat.v1.get_variable(f"k_{name}", [3, 3, c_in, c_out],
                                  initializer=tf.compat.v1.glorot_uniform_initializer())
    h = tf.nn.relu(tf.nn.conv2d(h, k, strides=1, padding="SAME"))
    return tf.nn.max_pool2d(h, 2, 2, "VALID")


with tf.compat.v1.device(device_fn):
    global_step = tf.compat.v1.train.get_or_create_global_step()
    x_in = tf.compat.v1.placeholder(tf.float32, [None, FEATURES])
    y_in = tf.compat.v1.placeholder(tf.float32, [None, 1])
    if args.model == "wide":
        h = dense(dense(x_in, FEATURES, args.width, "1"), args.width, args.width, "2")
        n = args.width
    else:
        img = tf.reshape(tf.tile(x_in, [1, 16]), [-1, 16, 16, 3])
        h = conv(conv(img, 3, 32, "1"), 32, 64, "2")
        h = dense(tf.reshape(h, [-1, 4 * 4 * 64]), 4 * 4 * 64, args.width, "3")
        n = args.width
    out = dense(h, n, 1, "out", relu=False)
    loss = tf.reduce_mean(tf.square(out - y_in))
    train_op = tf.compat.v1.train.GradientDescentOptimizer(args.learning_rate).minimize(loss, global_step=global_step)
    init_op = tf.compat.v1.global_variables_initializer()
    ready_op = tf.compat.v1.report_uninitialized_variables()

manager = tf.compat.v1.train.SessionManager(ready_op=ready_op, recovery_wait_secs=0.2)
sess = (manager.prepare_session(target, init_op=init_op, config=session_config) if is_chief
        else manager.wait_for_session(target, config=session_config, max_wait_secs=300))
step = 0
while True:
    x = data_rng.normal(size=(args.batch_size, FEATURES)).astype(np.float32)
    y = np.tanh(x @ teacher * 3)
    started = time.time()
    _, value, gstep = sess.run([train_op, loss, global_step], {x_in: x, y_in: y})
    print(f"step={step}, global_step={gstep}, loss={value:f}, duration={time.time() - started:f}s.", flush=True)
    if gstep >= args.steps:
        break
    step += 1
sess.close()
