"""dist_sync Gluon training that ends without mx.nd.waitall(): without the
runner's exit wait, the workers hang at interpreter exit (issue 12, defect 7)."""
import os
import mxnet as mx
from mxnet import autograd, gluon
kv = mx.kv.create("dist_sync")
net = gluon.nn.Dense(256, in_units=256)
net.initialize(mx.init.Xavier())
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01}, kvstore=kv)
x = mx.nd.random.uniform(shape=(64, 256))
for step in range(int(os.environ.get("STEPS", "20"))):
    with autograd.record():
        loss = (net(x) ** 2).mean()
    loss.backward()
    trainer.step(64)
print(f"rank {kv.rank} finished its steps", flush=True)
