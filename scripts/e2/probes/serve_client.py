"""The serve probe's HTTP client: stdlib only, because it also runs inside an engine
container (``docker exec`` of ``client_source()``), where only the image's python is.

In a container the call comes in E2_SERVE_CALL ({"op", "base", ...}) and the
answer goes to stdout as one JSON line.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import threading
import urllib.error
import urllib.request


def http(base: str, path: str, body: dict | None = None, timeout: float = 600) -> str:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + path, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode()


def running_now(base: str, timeout: float = 30) -> int:
    """``vllm:num_requests_running`` from /metrics, summed over engines."""
    gauge = re.compile(r"^vllm:num_requests_running(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M)
    return int(sum(float(v) for v in gauge.findall(http(base, "/metrics", timeout=timeout))))


def _read_running(base: str, poll: float, done: threading.Event, readings: list) -> None:
    """Append running_now() every ``poll`` seconds until ``done`` is set."""
    while not done.is_set():
        try:
            readings.append(running_now(base))
        except Exception:  # noqa: BLE001 - an answer lost mid-run is a missed reading
            pass
        done.wait(poll)


def post_all(base: str, bodies: list, timeout: float = 600, hold: float = 0.0,
             poll: float = 0.0, gap: float = 0.25) -> dict:
    """POST every body to /v1/completions at once (one thread each).

    Returns {"answers": one per body, in order, "running": readings of the running
    gauge}. ``poll`` > 0: the gauge is read every ``poll`` seconds (at most) from
    the first request until the last answer, by this client, beside the engine:
    on the Docker path this runs inside the container, where a reading costs
    milliseconds instead of a ``docker exec``.

    ``hold`` > 0: the engine is paused (dev mode's /pause?mode=keep queues new requests)
    while the bodies go in, ``gap`` seconds apart (so they queue in order), and resumed
    ``hold`` seconds after the last: its scheduler sees every request at once, in the
    same order, and runs the same schedule on every run.
    """
    import time

    answers: list = [None] * len(bodies)
    running: list = []
    done = threading.Event()

    def one(index: int) -> None:
        try:
            answers[index] = json.loads(http(base, "/v1/completions", bodies[index], timeout))
        except urllib.error.HTTPError as exc:
            answers[index] = {"error": f"HTTP {exc.code}: {exc.read()[:500]!r}"}
        except Exception as exc:  # noqa: BLE001 - reported per request
            answers[index] = {"error": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    sampler = threading.Thread(target=_read_running, args=(base, poll, done, running),
                               daemon=True)
    if hold > 0:
        http(base, "/pause?mode=keep", {}, 60)
    if poll > 0:
        sampler.start()
    try:
        try:
            for thread in threads:
                thread.start()
                if hold > 0:
                    time.sleep(gap)  # one at a time: the queue order is the prompts' order
            if hold > 0:
                time.sleep(hold)
        finally:
            if hold > 0:
                http(base, "/resume", {}, 60)
        for thread in threads:
            thread.join()
    finally:
        done.set()
    if poll > 0:
        sampler.join()
    return {"answers": answers, "running": running}


def _client_main() -> None:
    """Inside a container: E2_SERVE_CALL holds {"op", "base", ...}; the answer goes to stdout."""
    call = json.loads(os.environ["E2_SERVE_CALL"])
    try:
        if call["op"] == "get":
            print(json.dumps({"ok": True, "text": http(call["base"], call["path"],
                                                       timeout=call["timeout"])}))
        else:
            print(json.dumps({"ok": True, **post_all(
                call["base"], call["bodies"], call["timeout"], call["hold"], call["poll"],
                call.get("gap", 0.25))}))
    except Exception as exc:  # noqa: BLE001 - the probe decides what it means
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))


def client_source() -> str:
    """This module's client as a script for ``python3 -c`` (it runs ``_client_main``)."""
    parts = ["from __future__ import annotations", "import json, os, re, threading, "
             "urllib.error, urllib.request"]
    parts += [inspect.getsource(f) for f in (http, running_now, _read_running, post_all,
                                                   _client_main)]
    return "\n\n".join(parts) + "\n\n_client_main()\n"
