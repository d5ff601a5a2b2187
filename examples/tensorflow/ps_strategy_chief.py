"""TF2 ParameterServerStrategy: a chief drives ps and worker servers.

    pai -name tensorflow -Dscript=file://$PWD/examples/tensorflow/ps_strategy_chief.py \
        -Dcluster='{"chief":{"count":1},"ps":{"count":1},"worker":{"count":2}}'

This script runs only on the chief (the coordinator). paicli's runner gives every
ps and worker instance a plain tf.distribute.Server, and the chief schedules
training steps on the workers with a ClusterCoordinator; the variables live on the
ps. The job succeeds when this script exits 0; the servers are then stopped.

If it is started on a worker or ps anyway (-DscriptRoles=all, or outside paicli), it
becomes that instance's server itself, as TensorFlow's tutorial does.

Synthetic data (a noisy linear function made here): the loss visibly falls.
"""

import argparse
import os
import time

# Let the coordinator see a worker's failure instead of gRPC retrying forever.
os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

FEATURES = 10

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rounds", type=int, default=8, help="rounds of scheduled steps")
parser.add_argument("--steps_per_round", type=int, default=20)
parser.add_argument("--batch_size", type=int, default=32)
parser.add_argument("--learning_rate", type=float, default=0.02)
args = parser.parse_args()

resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
if resolver.task_type in ("worker", "ps"):
    server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                  task_index=resolver.task_id,
                                  protocol=resolver.rpc_layer or "grpc", start=True)
    server.join()
if resolver.task_type == "evaluator":
    # A side-car evaluator would read the chief's checkpoints; this example writes none.
    print("this example has no evaluation to do", flush=True)
    raise SystemExit(0)

strategy = tf.distribute.ParameterServerStrategy(resolver)
coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

rng = np.random.default_rng(1234)
true_w = rng.normal(size=(FEATURES, 1)).astype(np.float32)
x_all = rng.normal(size=(4096, FEATURES)).astype(np.float32)
y_all = x_all @ true_w + 0.1 * rng.normal(size=(4096, 1)).astype(np.float32)


def dataset_fn():
    return (tf.data.Dataset.from_tensor_slices((x_all, y_all))
            .shuffle(4096).repeat().batch(args.batch_size))


with strategy.scope():
    w = tf.Variable(tf.zeros([FEATURES, 1]), name="w")
    b = tf.Variable(tf.zeros([1]), name="b")
    global_step = tf.Variable(0, dtype=tf.int64, name="global_step")


@tf.function
def train_step(iterator):
    x, y = next(iterator)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
    grad_w, grad_b = tape.gradient(loss, [w, b])
    w.assign_sub(args.learning_rate * grad_w)
    b.assign_sub(args.learning_rate * grad_b)
    global_step.assign_add(1)
    return loss


iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
print(f"started training ({args.rounds} rounds of {args.steps_per_round} steps "
      f"on {len(resolver.cluster_spec().as_dict().get('worker', []))} workers)", flush=True)
for step in range(args.rounds):
    started = time.time()
    losses = [coordinator.schedule(train_step, args=(iterator,))
              for _ in range(args.steps_per_round)]
    coordinator.join()
    print(f"step={step}, global_step={global_step.numpy()}, loss={losses[-1].fetch():f}, "
          f"duration={time.time() - started:f}s.", flush=True)
print(f"chief done: global_step={global_step.numpy()}", flush=True)
