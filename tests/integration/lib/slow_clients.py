#!/usr/bin/env python3
"""Hostile clients against a running kiln server (loopback only; bounded in count and time; stops by itself).

Holds --slow-body connections that send their headers and then one body byte a second, --slow-header connections
that send one header byte a second, and --idle connections that send one request and then stay open (keep-alive);
a connection the server closes is opened again, so the load stays. Meanwhile --streams streamed chat completions
run and /health is asked every 100 ms on a new connection. Prints one summary line per measurement and a JSON
summary on the last line; exits 0 (the calling script judges the numbers).

  slow_clients.py --port P [--slow-body 1000 --slow-header 1000 --idle 1000 --streams 64 --seconds 15]
"""
import argparse
import http.client
import json
import multiprocessing
import selectors
import socket
import threading
import time


def connect(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setblocking(False)
    return s


class Attackers:
    """The slow and idle connections, driven by one thread: one byte a second on each slow one."""

    def __init__(self, port, slow_body, slow_header, idle):
        self.port = port
        self.sel = selectors.DefaultSelector()
        self.kinds = {"slow_body": slow_body, "slow_header": slow_header, "idle": idle}
        self.conns = {}  # socket -> [kind, bytes still to trickle]
        self.answers = {}  # status line prefix -> count, of what the server answered before closing
        self.closed = {k: 0 for k in self.kinds}
        self.connect_failures = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def open_one(self, kind):
        try:
            s = connect(self.port)
        except OSError:
            self.connect_failures += 1
            return
        if kind == "slow_body":
            head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100000\r\n\r\n")
            s.send(head)
            rest = b"{" + b" " * 99999
        elif kind == "slow_header":
            rest = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 4000
        else:
            s.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            rest = b""
        self.conns[s] = [kind, rest]
        self.sel.register(s, selectors.EVENT_READ)

    def open_all(self):
        for kind, n in self.kinds.items():
            for _ in range(n):
                self.open_one(kind)

    def on_readable(self, s):
        kind = self.conns[s][0]
        try:
            data = s.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data and kind == "idle" and not data.startswith(b"HTTP/1.1 408") and b"Connection: close" not in data:
            return  # the /health answer: stay open, idle
        if data:
            status = data.split(b"\r\n", 1)[0].decode(errors="replace")[:12]
            self.answers[status] = self.answers.get(status, 0) + 1
        self.sel.unregister(s)
        del self.conns[s]
        s.close()
        self.closed[kind] += 1
        if not self.stop.is_set():
            self.open_one(kind)  # keep the load

    def trickle(self):
        for s, entry in list(self.conns.items()):
            kind, rest = entry
            if not rest:
                continue
            try:
                s.send(rest[:1])
                entry[1] = rest[1:]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                pass  # the read side notices the close

    def run(self):
        next_tick = time.monotonic()
        while not self.stop.is_set():
            for key, _ in self.sel.select(timeout=0.05):
                if key.fileobj in self.conns:
                    self.on_readable(key.fileobj)
            if time.monotonic() >= next_tick:
                self.trickle()
                next_tick += 1.0

    def held(self):
        counts = {k: 0 for k in self.kinds}
        for kind, _ in list(self.conns.values()):
            counts[kind] += 1
        return counts

    def close_all(self):
        self.stop.set()
        self.thread.join()
        for s in list(self.conns):
            s.close()


def probe(port, path, timeout_s):
    """Seconds to connect, ask `path` and read the whole answer; None on failure or time-out."""
    t0 = time.monotonic()
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
        c.request("GET", path)
        r = c.getresponse()
        r.read()
        c.close()
        return (time.monotonic() - t0) if r.status == 200 else None
    except OSError:
        return None


def probe_loop(port, seconds, timeout_s, out):
    """/health every 100 ms (and /metrics every tenth time) for `seconds`; puts (health, metrics, failed)."""
    health, metrics, failed = [], [], 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = probe(port, "/health", timeout_s)
        if t is None:
            failed += 1
        else:
            health.append(t)
        if len(health) % 10 == 0:
            m = probe(port, "/metrics", timeout_s)
            if m is not None:
                metrics.append(m)
        time.sleep(0.1)
    out.put((health, metrics, failed))


def stream_once(port, i, timeout_s, results):
    body = json.dumps({"model": "battery", "stream": True, "max_tokens": 400,
                       "messages": [{"role": "user", "content": "stream %d " % i + "abcdefgh" * 40}]})
    t0 = time.monotonic()
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
        c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        text = r.read().decode(errors="replace")
        ok = r.status == 200 and "data: [DONE]" in text
        results[i] = {"ok": ok, "seconds": time.monotonic() - t0, "chunks": text.count("data: ")}
    except OSError as e:
        results[i] = {"ok": False, "seconds": time.monotonic() - t0, "error": str(e)}


def percentile(values, p):
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100.0 * (len(v) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--slow-body", type=int, default=1000)
    ap.add_argument("--slow-header", type=int, default=1000)
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=15.0, help="how long /health is measured under the load")
    ap.add_argument("--probe-timeout", type=float, default=3.0)
    args = ap.parse_args()

    attackers = Attackers(args.port, args.slow_body, args.slow_header, args.idle)
    t0 = time.monotonic()
    attackers.open_all()
    attackers.thread.start()
    time.sleep(1.5)  # every connection has sent something
    print("attack: %s connections open in %.1f s (%d connects failed)" %
          (attackers.held(), time.monotonic() - t0, attackers.connect_failures), flush=True)

    stream_results = {}
    streams = [threading.Thread(target=stream_once, args=(args.port, i, 60.0, stream_results), daemon=True)
               for i in range(args.streams)]
    for t in streams:
        t.start()
    ctx = multiprocessing.get_context("spawn")
    probes = ctx.Queue()
    prober = ctx.Process(target=probe_loop, args=(args.port, args.seconds, args.probe_timeout, probes))
    prober.start()  # a process of its own: the attackers' thread does not delay its measurements
    health, metrics, failed = probes.get(timeout=args.seconds + 60)
    prober.join()
    held = attackers.held()
    for t in streams:
        t.join(timeout=max(1.0, 60.0 - args.seconds))
    attackers.close_all()

    streams_ok = sum(1 for r in stream_results.values() if r.get("ok"))
    summary = {
        "health_probes": len(health) + failed,
        "health_failed": failed,
        "health_ms_p50": round(1000 * percentile(health, 50), 1) if health else None,
        "health_ms_p99": round(1000 * percentile(health, 99), 1) if health else None,
        "health_ms_max": round(1000 * max(health), 1) if health else None,
        "health_over_100ms": sum(1 for h in health if h >= 0.1),
        "metrics_ms_max": round(1000 * max(metrics), 1) if metrics else None,
        "streams": args.streams,
        "streams_ok": streams_ok,
        "stream_s_max": round(max((r["seconds"] for r in stream_results.values()), default=0), 2),
        "held_at_end": held,
        "closed_by_server": attackers.closed,
        "server_answers": attackers.answers,
    }
    print("summary: " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
