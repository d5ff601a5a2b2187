"""The baseline of bench/bench_serving.py: a model behind a minimal aiohttp handler
written by hand, one process, TensorFlow Serving's row form only.

    serving_baseline.py PORT MODEL.keras|MODEL.onnx

Runs in the model's runtime (aiohttp from a requirement layer); prints `ready` once
it listens.
"""

import sys

import numpy as np
from aiohttp import web


def main():
    port, path = int(sys.argv[1]), sys.argv[2]
    if path.endswith(".onnx"):
        import onnxruntime
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name

        def model(x):
            return session.run(None, {name: x})[0]
    else:
        import keras
        net = keras.saving.load_model(path, compile=False)

        def model(x):
            return np.asarray(net(x, training=False))

    async def predict(request):
        rows = np.asarray((await request.json())["instances"], dtype=np.float32)
        return web.json_response({"predictions": model(rows).tolist()})

    model(np.zeros((1, 28, 28, 1), np.float32))
    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/models/{name}:predict", predict)
    print("ready", flush=True)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


if __name__ == "__main__":
    main()
