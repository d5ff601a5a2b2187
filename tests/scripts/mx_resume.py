"""An MXNet worker that resumes from its latest checkpoint (issue 17, "Checkpoints outlive
nodes"): Gluon linear regression over the job's dist kvstore, saving its parameters with
MXNet's own `save_parameters` into --checkpointDir every step and, when started again,
restoring the latest with `load_parameters`, so it continues from that step.

Prints `first step N` once, then `step=N, loss=L` per step (N counts from 1)."""

import argparse
import os
import re
import time

import mxnet as mx
from mxnet import autograd, gluon

NAME = re.compile(r"^linear-(\d{6})\.params$")

p = argparse.ArgumentParser()
p.add_argument("--checkpointDir", required=True)
p.add_argument("--steps", type=int, default=120)
p.add_argument("--step-sleep", type=float, default=0.1)
a, _ = p.parse_known_args()

kv = mx.kv.create(os.environ.get("PAI_MXNET_KVSTORE", "local"))
net = gluon.nn.Dense(1, in_units=4, use_bias=False)
saved = sorted(int(m.group(1)) for m in map(NAME.match, os.listdir(a.checkpointDir)) if m)
start = saved[-1] if saved else 0
if start:
    net.load_parameters(os.path.join(a.checkpointDir, f"linear-{start:06d}.params"))
else:
    net.initialize(mx.init.Zero())
print(f"first step {start}", flush=True)
# plain SGD keeps no optimizer state: the parameters are the whole checkpoint
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05}, kvstore=kv)
true_w = mx.nd.array([[1.0], [2.0], [3.0], [4.0]])
mx.random.seed(start)
for step in range(start, a.steps):
    x = mx.nd.random.normal(shape=(16, 4))
    with autograd.record():
        loss = ((net(x) - mx.nd.dot(x, true_w)) ** 2).mean()
    loss.backward()
    trainer.step(1)
    path = os.path.join(a.checkpointDir, f"linear-{step + 1:06d}.params")
    # written aside then renamed, so a sync never copies half a checkpoint
    net.save_parameters(path + ".tmp")
    os.replace(path + ".tmp", path)
    if step >= 1:
        old = os.path.join(a.checkpointDir, f"linear-{step - 1:06d}.params")
        if os.path.exists(old):
            os.remove(old)
    print(f"step={step + 1}, loss={loss.asscalar():.6f}", flush=True)
    time.sleep(a.step_sleep)
mx.nd.waitall()
