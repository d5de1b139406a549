"""The config the e2e Prometheus harness (tests/kube/prometheus.py) writes: one scrape config
per job and path, each target's instance label its process's name, the interval in ms."""

from __future__ import annotations

import types

from tests.kube import prometheus as prom


def test_one_scrape_config_per_job_with_named_instances() -> None:
    got = prom.config(
        [
            prom.Target("agent", "agent-b", 2002),
            prom.Target("controller", "controller-c1", 1001),
            prom.Target("agent", "agent-a", 2001),
        ],
        interval_s=0.5,
    )
    assert got["global"] == {
        "scrape_interval": "500ms",
        "scrape_timeout": "500ms",
        "evaluation_interval": "500ms",
    }
    assert got["scrape_configs"] == [
        {
            "job_name": "agent",
            "metrics_path": "/metrics",
            "static_configs": [
                {"targets": ["127.0.0.1:2002"], "labels": {"instance": "agent-b"}},
                {"targets": ["127.0.0.1:2001"], "labels": {"instance": "agent-a"}},
            ],
        },
        {
            "job_name": "controller",
            "metrics_path": "/metrics",
            "static_configs": [
                {"targets": ["127.0.0.1:1001"], "labels": {"instance": "controller-c1"}}
            ],
        },
    ]


def test_two_paths_of_one_job_get_distinct_job_names() -> None:
    got = prom.config(
        [prom.Target("agent", "a", 1), prom.Target("agent", "a", 1, path="/gpu/metrics")]
    )
    assert [(c["job_name"], c["metrics_path"]) for c in got["scrape_configs"]] == [
        ("agent/gpu/metrics", "/gpu/metrics"),
        ("agent/metrics", "/metrics"),
    ]


def test_targets_of_a_system_by_process_name() -> None:
    system = types.SimpleNamespace(
        metrics_ports={"controller-c1": 3, "agent-ctl-a100": 1, "fleet": 2, "webhook": 4}
    )
    assert prom.targets_of(system) == [
        prom.Target("agent", "agent-ctl-a100", 1),
        prom.Target("controller", "controller-c1", 3),
        prom.Target("fleet", "fleet", 2),
        prom.Target("webhook", "webhook", 4),
    ]
