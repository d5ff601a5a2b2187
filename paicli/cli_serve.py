"""`pai serve MODEL`: a model answering requests, as a `-name serving` job (paicli/serving.py,
docs/serving.md): the default command of the `pai serve` group (paicli/cli_scale.py).
Registered by paicli.cli."""

from __future__ import annotations

import click

from paicli.cli_scale import serve
from paicli.commands import echo, echo_json, open_store, runtime_progress, submit_statement


@click.command("start")
@click.argument("model")
@click.option("--name", help="The model's name in the URL (default: its folder or file name).")
@click.option("--replicas", type=int, default=1, show_default=True, help="Replica instances.")
@click.option("--port", type=int, help="The router's port (default 8501).")
@click.option("--host", help="The router's address (default 127.0.0.1; 0.0.0.0: every interface).")
@click.option("--version", "version", type=int, help="The version it is served as (default 1).")
@click.option("--max-batch-size", type=int, help="Combine concurrent requests into calls of up to this many rows.")
@click.option("--batch-timeout-micros", type=int, help="How long a batch waits for more requests (default 1000).")
@click.option("--num-batch-threads", type=int, help="Batches a replica runs at once (default 1).")
@click.option("--quantize", type=click.Choice(["none", "int8"]),
              help="int8: serve the model converted to ONNX and quantised (needs --check).")
@click.option("--check", help="With --quantize int8: a labelled CSV (last column the label) both models are checked on.")
@click.option("--max-accuracy-drop", type=float,
              help="With --quantize int8: the most accuracy, in points, the int8 model may lose (default 1).")
@click.option("--json", "as_json", is_flag=True, help="Print the job ID and URL as JSON.")
def start(model, replicas, as_json, **options):
    """Start serving MODEL: the statement `pai -name serving -Dmodel=MODEL ...`,
    submitted detached. Prints the job ID and the URL clients use:

    \b
      curl -d '{"instances": [...]}' http://127.0.0.1:8501/v1/models/NAME:predict
      curl -d '{"inputs": [...]}' http://127.0.0.1:8501/v2/models/NAME/infer
    """
    from paicli import serving

    store = open_store()
    started = serving.service(store, submit_statement(serving.serve_statement(model, replicas, options), store,
                                                      runtime_progress()))
    if as_json:
        echo_json(started)
        return
    echo(f"ID = {started['id']}")
    echo(f"serving {started['name']} ({started['kind']}, {started['replicas']} replica(s)) at {started['url']}")
    if started.get("token"):
        echo(f"clients send the header `Authorization: Bearer {started['token']}` (--host is not this machine)")


def register(cli: click.Group) -> None:
    serve.set_default(start)   # `pai serve MODEL ...` is `pai serve start MODEL ...`
