"""The server's Prometheus metrics, in a registry of its own (no process-wide state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("txl_requests", "Requests answered", ["route", "status"], registry=r)
        self.latency = Histogram("txl_request_seconds", "Time from request to the end of the response", ["route"],
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.tokens_read = Counter("txl_tokens_read", "Tokens read into sessions (text, prompts, generated)",
                                   registry=r)
        self.tokens_generated = Counter("txl_tokens_generated", "Tokens generated", registry=r)
        self.sessions_in_memory = Gauge("txl_sessions_in_memory", "Sessions held in RAM", registry=r)
        self.sessions_on_disk = Gauge("txl_sessions_on_disk", "Sessions whose state is written in the state directory",
                                      registry=r)
        self.evictions = Counter("txl_evictions", "Sessions written to disk and dropped from RAM", registry=r)
        self.queue_depth = Gauge("txl_queue_depth", "Requests waiting for the model", registry=r)
        self.forward_seconds = Histogram("txl_forward_seconds", "Time of one batched forward pass, by kind of work",
                                         ["kind"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                            1, 2.5), registry=r)
        self.write_seconds = Histogram("txl_state_write_seconds", "Time to write a session's state file (atomic, "
                                       "fsynced) after a request changed it", buckets=(0.0005, 0.001, 0.0025, 0.005,
                                                                                     0.01, 0.025, 0.05, 0.1, 0.5),
                                       registry=r)
        self.batch_rows = Histogram("txl_batch_rows", "Sessions per forward pass", buckets=(1, 2, 4, 8, 16, 32, 64),
                                    registry=r)
