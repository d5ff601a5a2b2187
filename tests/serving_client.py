"""A client of the two serving protocols, written only from their published documents:
TensorFlow Serving's RESTful API page (model status, model metadata, predict in the
row and column forms, `{"error": ...}` on failure) and the Open Inference Protocol's
REST page (health, server and model metadata, model ready, infer with its tensor
objects). It checks every answer against what those documents say an answer holds,
and knows nothing of paicli's server.
"""

from __future__ import annotations

import http.client
import json
from math import prod
from urllib.parse import urlsplit


class Answer:
    def __init__(self, status: int, body: bytes):
        self.status, self.body = status, body

    @property
    def json(self):
        return json.loads(self.body)


class Client:
    """One keep-alive connection to `url` (http://host:port); `headers` go with every request."""

    def __init__(self, url: str, headers: dict | None = None, timeout: float = 60):
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        self.headers = dict(headers or {})

    def close(self) -> None:
        self.conn.close()

    def request(self, method: str, path: str, body=None, raw: bytes | None = None) -> Answer:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = dict(self.headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        self.conn.request(method, path, body=data, headers=headers)
        response = self.conn.getresponse()
        answer = Answer(response.status, response.read())
        if response.will_close:
            self.conn.close()   # http.client opens a new one for the next request
        return answer

    # -- TensorFlow Serving REST ------------------------------------------------------

    def tf_status(self, name: str, version: str | None = None) -> list:
        """GET /v1/models/NAME[/versions/V]: a GetModelStatusResponse, its model_version_status."""
        answer = self.request("GET", f"/v1/models/{name}" + (f"/versions/{version}" if version else ""))
        assert answer.status == 200, answer.body
        statuses = answer.json["model_version_status"]
        for status in statuses:
            assert set(status) >= {"version", "state", "status"}, status
        return statuses

    def tf_metadata(self, name: str) -> dict:
        """GET /v1/models/NAME/metadata: the model_spec and the signature_def map."""
        answer = self.request("GET", f"/v1/models/{name}/metadata")
        assert answer.status == 200, answer.body
        body = answer.json
        assert body["model_spec"]["name"] == name, body
        return body["metadata"]["signature_def"]["signature_def"]

    def tf_predict_rows(self, name: str, instances: list, version: str | None = None):
        """The row form: {"instances": [...]} -> "predictions" (a list, one item per instance)."""
        path = f"/v1/models/{name}" + (f"/versions/{version}" if version else "") + ":predict"
        answer = self.request("POST", path, {"instances": instances})
        assert answer.status == 200, answer.body
        predictions = answer.json["predictions"]
        assert isinstance(predictions, list) and len(predictions) == len(instances), predictions
        return predictions

    def tf_predict_columns(self, name: str, inputs):
        """The column form: {"inputs": value-or-object} -> "outputs"."""
        answer = self.request("POST", f"/v1/models/{name}:predict", {"inputs": inputs})
        assert answer.status == 200, answer.body
        return answer.json["outputs"]

    def tf_error(self, method: str, path: str, body=None, raw: bytes | None = None) -> Answer:
        """A request that must fail: an HTTP error status and {"error": <message string>}."""
        answer = self.request(method, path, body, raw)
        assert answer.status >= 400, (answer.status, answer.body)
        assert isinstance(answer.json.get("error"), str) and answer.json["error"], answer.body
        return answer

    # -- Open Inference Protocol REST ---------------------------------------------------

    def v2_live(self) -> bool:
        return self.request("GET", "/v2/health/live").status == 200

    def v2_ready(self) -> bool:
        return self.request("GET", "/v2/health/ready").status == 200

    def v2_model_ready(self, name: str) -> bool:
        return self.request("GET", f"/v2/models/{name}/ready").status == 200

    def v2_server(self) -> dict:
        answer = self.request("GET", "/v2")
        assert answer.status == 200, answer.body
        assert set(answer.json) >= {"name", "version", "extensions"}, answer.body
        return answer.json

    def v2_metadata(self, name: str) -> dict:
        """$metadata_model_response: name, platform, inputs and outputs as $metadata_tensor."""
        answer = self.request("GET", f"/v2/models/{name}")
        assert answer.status == 200, answer.body
        body = answer.json
        assert body["name"] == name and isinstance(body["platform"], str), body
        for tensor in body["inputs"] + body["outputs"]:
            assert set(tensor) >= {"name", "datatype", "shape"}, tensor
        return body

    def v2_infer(self, name: str, inputs: list, outputs: list | None = None, request_id: str | None = None,
                 version: str | None = None) -> dict:
        """$inference_request -> $inference_response's outputs by name, each checked:
        name, shape, datatype, and as many data elements as its shape holds."""
        body: dict = {"inputs": inputs}
        if request_id is not None:
            body["id"] = request_id
        if outputs is not None:
            body["outputs"] = [{"name": n} for n in outputs]
        path = f"/v2/models/{name}" + (f"/versions/{version}" if version else "") + "/infer"
        answer = self.request("POST", path, body)
        assert answer.status == 200, answer.body
        response = answer.json
        assert response["model_name"] == name, response
        if request_id is not None:
            assert response["id"] == request_id, response
        out = {}
        for tensor in response["outputs"]:
            assert set(tensor) >= {"name", "shape", "datatype", "data"}, tensor
            assert len(flatten(tensor["data"])) == prod(tensor["shape"]), tensor
            out[tensor["name"]] = tensor
        if outputs is not None:
            assert list(out) == outputs, out
        return out


def flatten(data) -> list:
    """Tensor data in its natural nested form or flat: the elements in row-major order."""
    if not isinstance(data, list):
        return [data]
    return [x for item in data for x in flatten(item)]


def nested(flat: list, shape: list):
    """Flat row-major data back in its natural nested form."""
    if not shape:
        return flat[0]
    step = prod(shape[1:]) if len(shape) > 1 else 1
    return [nested(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def conformance(client: Client, name: str, rows: list, datatype: str = "FP32") -> dict:
    """Every endpoint of both documents against a model with one input, asked for `rows`
    (each row a nested list): the predictions of each way of asking, to be compared."""
    assert client.v2_live() and client.v2_ready() and client.v2_model_ready(name)
    client.v2_server()
    statuses = client.tf_status(name)
    assert any(s["state"] == "AVAILABLE" for s in statuses), statuses
    version = statuses[0]["version"]
    client.tf_status(name, version)
    signatures = client.tf_metadata(name)
    assert "serving_default" in signatures, signatures
    meta = client.v2_metadata(name)
    assert len(meta["inputs"]) == 1, meta
    input_name = meta["inputs"][0]["name"]
    shape = [len(rows)] + row_shape(rows[0])
    got = {"rows": client.tf_predict_rows(name, rows, version=version),
           "columns": client.tf_predict_columns(name, rows),
           "named_columns": client.tf_predict_columns(name, {input_name: rows})}
    flat = client.v2_infer(name, [{"name": input_name, "shape": shape, "datatype": datatype,
                                   "data": flatten(rows)}], request_id="42")
    first = meta["outputs"][0]["name"]
    got["v2_flat"] = nested(flatten(flat[first]["data"]), flat[first]["shape"])
    natural = client.v2_infer(name, [{"name": input_name, "shape": shape, "datatype": datatype, "data": rows}],
                              outputs=[first], version=version)
    got["v2_nested"] = nested(flatten(natural[first]["data"]), natural[first]["shape"])
    return got


def row_shape(row) -> list:
    shape = []
    while isinstance(row, list):
        shape.append(len(row))
        row = row[0]
    return shape
