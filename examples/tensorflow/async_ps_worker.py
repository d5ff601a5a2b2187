"""TF1-compat asynchronous ps/worker training: the README's main example.

    pai -name tensorflow -Dscript=file://$PWD/examples/tensorflow/async_ps_worker.py \
        -Dcluster='{"ps":{"count":1},"worker":{"count":2}}'

Between-graph replication as PAI ran it in 2016: the ps holds the variables
(replica_device_setter puts them there), each worker builds its own graph and
updates them asynchronously until the shared global_step reaches --steps. The
cluster comes from TF_CONFIG, which paicli's runner sets for every instance.

Non-chief workers wait for the chief to initialise the variables through a
SessionManager polling every 0.2 s; MonitoredTrainingSession would make them sleep
30 s (its recovery_wait_secs) whenever they ask before the chief is done.

The data is synthetic (a noisy linear function made here), so nothing is downloaded;
the loss visibly falls from about 10 towards the noise level.
"""

import argparse
import json
import os
import time

import numpy as np
import tensorflow as tf

FEATURES = 10

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=300, help="train until global_step reaches this")
parser.add_argument("--batch_size", type=int, default=32)
parser.add_argument("--learning_rate", type=float, default=0.01)
parser.add_argument("--log_every", type=int, default=25, help="print a step line every N local steps")
parser.add_argument("--checkpointDir", help="accepted as PAI passed it; this example saves nothing")
args = parser.parse_args()

tf.compat.v1.disable_eager_execution()

config = json.loads(os.environ.get("TF_CONFIG") or "{}")
cluster = config.get("cluster") or {}
task_type = config.get("task", {}).get("type", "worker")
task_index = int(config.get("task", {}).get("index", 0))

if cluster:
    cluster_spec = tf.train.ClusterSpec(cluster)
    server = tf.compat.v1.train.Server(cluster_spec, job_name=task_type, task_index=task_index)
    if task_type == "ps":
        print(f"ps:{task_index} serving variables", flush=True)
        server.join()  # never returns: the launcher stops the ps once the workers are done
    target = server.target
    device_fn = tf.compat.v1.train.replica_device_setter(
        worker_device=f"/job:{task_type}/task:{task_index}", cluster=cluster_spec)
    # Only talk to the ps and ourselves: no waiting for the other workers to come up,
    # and no hanging when one of them has already finished.
    session_config = tf.compat.v1.ConfigProto(
        device_filters=["/job:ps", f"/job:{task_type}/task:{task_index}"])
    is_chief = task_type == "chief" or ("chief" not in cluster and task_index == 0)
else:  # no cluster: train in-process
    target, device_fn, session_config, is_chief = "", None, None, True

rng = np.random.default_rng(1234)
true_w = rng.normal(size=(FEATURES, 1)).astype(np.float32)
data_rng = np.random.default_rng(task_index + 1)  # each worker its own shard of samples


def batch():
    x = data_rng.normal(size=(args.batch_size, FEATURES)).astype(np.float32)
    y = x @ true_w + 0.1 * data_rng.normal(size=(args.batch_size, 1)).astype(np.float32)
    return x, y


with tf.compat.v1.device(device_fn):
    global_step = tf.compat.v1.train.get_or_create_global_step()
    w = tf.compat.v1.get_variable("w", [FEATURES, 1], initializer=tf.compat.v1.zeros_initializer())
    b = tf.compat.v1.get_variable("b", [1], initializer=tf.compat.v1.zeros_initializer())
    x_in = tf.compat.v1.placeholder(tf.float32, [None, FEATURES])
    y_in = tf.compat.v1.placeholder(tf.float32, [None, 1])
    loss = tf.reduce_mean(tf.square(tf.matmul(x_in, w) + b - y_in))
    train_op = tf.compat.v1.train.GradientDescentOptimizer(args.learning_rate).minimize(
        loss, global_step=global_step)
    init_op = tf.compat.v1.global_variables_initializer()
    ready_op = tf.compat.v1.report_uninitialized_variables()

manager = tf.compat.v1.train.SessionManager(ready_op=ready_op, recovery_wait_secs=0.2)
if is_chief:
    sess = manager.prepare_session(target, init_op=init_op, config=session_config)
else:
    sess = manager.wait_for_session(target, config=session_config, max_wait_secs=300)
print(f"started training (until the global step reaches {args.steps})", flush=True)

step = 0
while True:
    x, y = batch()
    started = time.time()
    _, loss_value, gstep = sess.run([train_op, loss, global_step], {x_in: x, y_in: y})
    duration = time.time() - started
    done = gstep >= args.steps
    if step % args.log_every == 0 or done:
        print(f"step={step}, global_step={gstep}, loss={loss_value:f}, duration={duration:f}s.",
              flush=True)
    if done:
        break
    step += 1
sess.close()
print(f"{task_type}:{task_index} done after {step + 1} local steps", flush=True)
