"""A communication-bound TF1 ps/worker job: a wide MLP whose weights outweigh its compute.

    pai -name tensorflow -Dscript=file://$PWD/examples/pluto/tf_wide_mlp.py \
        -Dcluster='{"ps":{"count":1},"worker":{"count":2}}'
    pai plan -name tensorflow -Dscript=file://$PWD/examples/pluto/tf_wide_mlp.py

Between-graph asynchronous training as examples/tensorflow/async_ps_worker.py, but
with four dense layers (about --width^2 x 2 + --width x 32 weights; 4.3 MB at the
default width 640). Weights and biases are created in turn, so TF's round-robin
placement puts every weight matrix on the even ps and every bias on the odd one:
with two ps one holds nearly all the bytes. Pluto's greedy placement
(-DpsStrategy=greedy) balances them, without any change to this script.
Synthetic data (a fixed random teacher network), so the loss falls.
"""

import argparse
import json
import os
import time

import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=60, help="train until global_step reaches this")
parser.add_argument("--batch_size", type=int, default=32)
parser.add_argument("--learning_rate", type=float, default=0.02)
parser.add_argument("--width", type=int, default=640)
parser.add_argument("--features", type=int, default=32)
args = parser.parse_args()

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
teacher = rng.normal(size=(args.features, 1)).astype(np.float32) / np.sqrt(args.features)
data_rng = np.random.default_rng(100 + task_index)

with tf.compat.v1.device(device_fn):
    global_step = tf.compat.v1.train.get_or_create_global_step()
    x_in = tf.compat.v1.placeholder(tf.float32, [None, args.features])
    y_in = tf.compat.v1.placeholder(tf.float32, [None, 1])
    sizes = [args.features, args.width, args.width, args.width // 2, 1]
    h = x_in
    for i in range(len(sizes) - 1):
        w = tf.compat.v1.get_variable(f"w{i}", [sizes[i], sizes[i + 1]],
                                      initializer=tf.compat.v1.glorot_uniform_initializer())
        b = tf.compat.v1.get_variable(f"b{i}", [sizes[i + 1]], initializer=tf.compat.v1.zeros_initializer())
        h = tf.matmul(h, w) + b
        if i < len(sizes) - 2:
            h = tf.nn.relu(h)
    loss = tf.reduce_mean(tf.square(h - y_in))
    train_op = tf.compat.v1.train.GradientDescentOptimizer(args.learning_rate).minimize(loss, global_step=global_step)
    init_op = tf.compat.v1.global_variables_initializer()
    ready_op = tf.compat.v1.report_uninitialized_variables()

manager = tf.compat.v1.train.SessionManager(ready_op=ready_op, recovery_wait_secs=0.2)
sess = (manager.prepare_session(target, init_op=init_op, config=session_config) if is_chief
        else manager.wait_for_session(target, config=session_config, max_wait_secs=300))
step = 0
while True:
    x = data_rng.normal(size=(args.batch_size, args.features)).astype(np.float32)
    y = np.tanh(x @ teacher * 3)
    started = time.time()
    _, value, gstep = sess.run([train_op, loss, global_step], {x_in: x, y_in: y})
    print(f"step={step}, global_step={gstep}, loss={value:f}, duration={time.time() - started:f}s.", flush=True)
    if gstep >= args.steps:
        break
    step += 1
sess.close()
