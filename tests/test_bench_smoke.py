"""The bench scripts still run: each, with `--quick`, exits 0 and writes the figures it promises.

Only the shape of the output is checked, never a number: performance is measured by
`bench/`, not asserted here (DESIGN.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import Dockerd

    from agentbox.machines.images import Image

BENCH = Path(__file__).resolve().parent.parent / "bench"
#: Seconds one `--quick` run may take (the full runs take about three minutes each).
QUICK_RUN_TIMEOUT = 240

SANDBOX_FIGURES = {
    "bare_spawn",
    "asyncio_spawn",
    "exec_true_layer_on",
    "exec_true_layer_off",
    "bwrap_oneshot",
    "cold_start_net_off_layer_on",
    "cold_start_net_off_layer_off",
    "cold_start_net_on_layer_on",
    "cold_start_net_on_layer_off",
    "agent_alone_rss",
    "idle_rss_net_off",
    "idle_pss_net_off",
    "idle_total_net_off",
    "idle_rss_net_on",
    "idle_pss_net_on",
    "idle_total_net_on",
}
API_FIGURES = {
    "bare_spawn",
    "api_first_command",
    "api_exec_true",
    "api_fs_write_1k",
    "api_fs_read_1k",
    "api_watch_host_write",
    "api_watch_sandbox_write",
    "api_grep_tree",
    "rg_plain_tree",
    "api_exec_16_clients_throughput",
    "api_exec_16_clients_latency",
}
E2B_FIGURES = {"bare_spawn", "e2b_create_to_first_run", "e2b_run_true", "api_exec_true"}
TOOLS_FIGURES = {
    "host_read_4k",
    "files_read_text_4k",
    "tool_read_file_4k",
    "rg_tree",
    "grep_tree",
    "tool_grep_tree",
    "bare_spawn",
    "machine_exec_true",
    "commands_run_true",
    "tool_bash_true",
}
HOTPATH_FIGURES = {
    "stage_machine_exec", "stage_commands_run", "stage_asgi_exec", "stage_asgi_health", "stage_asgi_read",
    "stage_asgi_session_read",
    "bare_spawn", "raw_write_1k", "raw_read_1k", "api_exec_true", "api_v1_shell_exec_true", "peer_exec_true",
    "api_fs_write_1k", "peer_fs_write_1k", "api_fs_read_1k", "peer_fs_read_1k", "api_health",
    "api_exec_16_clients_throughput", "peer_exec_16_clients_throughput", "api_grep_tree",
    "machine_exec_true", "machine_exec_bash_true", "commands_run_true", "tool_bash_true",
    "api_exec_true_back_to_back", "api_health_back_to_back", "api_exec_true_after_idle", "api_health_after_idle",
    # the same rows through httpx, beside the lean client's
    "api_exec_true_httpx", "api_v1_shell_exec_true_httpx", "peer_exec_true_httpx", "api_fs_write_1k_httpx",
    "peer_fs_write_1k_httpx", "api_fs_read_1k_httpx", "peer_fs_read_1k_httpx", "api_health_httpx",
    "api_httpx_exec_16_clients_throughput", "peer_httpx_exec_16_clients_throughput",
}  # fmt: skip
SESSIONS_FIGURES = {
    "health_rtt",
    "session_turn_started",
    "session_post_to_started",
    "sessions_sandbox_warmup",
    "sessions_load_turns",
    "sessions_load_events",
    "sessions_load_event_latency",
    "server_rss_idle",
    "server_rss_peak",
    "sandboxes_rss_peak",
}
#: Each tool row's ratios to the layers it calls (`extra.ratio_to_<layer>`).
TOOLS_LAYER_RATIOS = {
    "tool_read_file_4k": {"ratio_to_files_read_text"},
    "tool_grep_tree": {"ratio_to_workspace_grep"},
    "tool_bash_true": {"ratio_to_machine_exec", "ratio_to_commands_run"},
}
FIGURE_FIELDS = {
    "key",
    "label",
    "unit",
    "median",
    "p95",
    "raw",
    "raw_label",
    "ratio",
    "target",
    "met",
    "samples",
}


def run_quick(script: str, out: Path, *extra: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", "--json", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=QUICK_RUN_TIMEOUT,
    )
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "operation" in proc.stdout  # the table was printed
    return dict(json.loads(out.read_text()))


def check_figures(document: dict[str, Any], expected: set[str], script: str) -> None:
    assert document["script"] == script
    assert document["quick"] is True
    figures = document["figures"]
    assert expected <= set(figures), f"missing figures: {sorted(expected - set(figures))}"
    for key, figure in figures.items():
        assert set(figure) >= FIGURE_FIELDS, key
        assert figure["key"] == key
        assert isinstance(figure["median"], int | float), key
        if figure["raw"] is not None:
            assert isinstance(figure["ratio"], int | float), key
        if figure["target"] is not None:
            assert isinstance(figure["met"], bool), key


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 30)
def test_bench_sandbox_quick(tmp_path: Path) -> None:
    document = run_quick(
        "bench_sandbox.py", tmp_path / "sandbox.json", "--sandboxes", "2", "--sandboxes-net", "1"
    )
    check_figures(document, SANDBOX_FIGURES, "bench_sandbox")
    assert document["figures"]["idle_rss_net_off"]["samples"] == 2
    assert document["figures"]["idle_rss_net_on"]["samples"] == 1


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 30)
def test_bench_api_quick(tmp_path: Path) -> None:
    document = run_quick("bench_api.py", tmp_path / "api.json")
    check_figures(document, API_FIGURES, "bench_api")
    assert document["missing_routes"] == []


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 30)
def test_bench_e2b_quick(tmp_path: Path) -> None:
    document = run_quick("bench_e2b.py", tmp_path / "e2b.json")
    check_figures(document, E2B_FIGURES, "bench_e2b")


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 30)
def test_bench_hotpath_quick(tmp_path: Path) -> None:
    """Against SWE-ReX in its own virtualenv (made on first use, so the first run installs it)."""
    document = run_quick("bench_hotpath.py", tmp_path / "hotpath.json")
    check_figures(document, HOTPATH_FIGURES, "bench_hotpath")
    figures = document["figures"]
    assert figures["api_exec_true"]["raw_label"] == "SWE-ReX"
    assert figures["api_exec_true_httpx"]["raw_label"] == "SWE-ReX (httpx)"
    assert figures["api_exec_true_httpx"]["target"] is None
    assert figures["api_exec_16_clients_throughput"]["target"]["kind"] == "at_least"
    for regime in ("back_to_back", "after_idle"):
        assert figures[f"api_exec_true_{regime}"]["raw_label"] == f"SWE-ReX, {regime.replace('_', ' ')}"
        assert figures[f"api_exec_true_{regime}"]["raw"] > 0
    assert document["served_root"]["system_layer_kind"] in ("kernel-overlay", "fuse-overlayfs", "none")
    assert figures["tool_bash_true"]["raw"] == figures["machine_exec_true"]["median"]
    load = figures["api_exec_16_clients_throughput"]["extra"]
    assert set(load["cpu_ms_per_request"]) == {"server", "exec agent", "commands", "clients"}
    assert set(load["raw_cpu_ms_per_spawn"]) == {"threads", "commands"}
    # the commands' time is what the exec agent reaped: read off another process, it is zero
    assert load["cpu_ms_per_request"]["server"] > 0 and load["cpu_ms_per_request"]["commands"] > 0
    assert load["raw_cpu_ms_per_spawn"]["commands"] > 0
    before_after = load["raw_req_per_s_before_after"]
    assert len(before_after) == 2 and figures["api_exec_16_clients_throughput"]["raw"] == max(before_after)
    assert set(figures["peer_exec_16_clients_throughput"]["extra"]["cpu_ms_per_request"]) == {
        "server", "commands", "clients",
    }  # fmt: skip


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 30)
def test_bench_tools_quick(tmp_path: Path) -> None:
    document = run_quick("bench_tools.py", tmp_path / "tools.json")
    check_figures(document, TOOLS_FIGURES, "bench_tools")
    assert document["toolset"] == "default" and document["tier"] == "full-auto"
    for key, ratios in TOOLS_LAYER_RATIOS.items():
        extra = document["figures"][key]["extra"]
        assert ratios <= set(extra), f"{key}: missing {sorted(ratios - set(extra))}"
        assert all(isinstance(extra[r], int | float) for r in ratios), key


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 30)
def test_bench_sessions_quick(tmp_path: Path) -> None:
    document = run_quick("bench_sessions.py", tmp_path / "sessions.json")
    check_figures(document, SESSIONS_FIGURES, "bench_sessions")
    assert document["missing_routes"] == []
    assert document["counts"]["sessions"] == 3


#: bench_runtime's figures in a --quick run (sizes 10 and 200).
RUNTIME_FIGURES = {
    "transcript_10", "context_request_10", "transcript_200", "context_request_200",
    "compaction_200", "context_request_200_compacted",
}  # fmt: skip


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 30)
def test_bench_runtime_quick(tmp_path: Path) -> None:
    document = run_quick("bench_runtime.py", tmp_path / "runtime.json")
    check_figures(document, RUNTIME_FIGURES, "bench_runtime")
    assert document["figures"]["compaction_200"]["extra"] == {"compacted": True}
    assert (
        document["figures"]["context_request_200"]["raw"] == document["figures"]["transcript_200"]["median"]
    )


#: bench_images's figures; the fuse-overlayfs rows need a root server (fuse-overlayfs runs as root).
IMAGES_FIGURES = {
    "bare_spawn", "asyncio_spawn", "bwrap_overlay_true", "bwrap_overlay_python", "overlay_probe",
    "cold_kernel_overlay", "cold_no_layer", "cold_kernel_overlay_net_on", "exec_true_kernel_overlay",
    "agent_alone_pss", "idle_pss_kernel_overlay", "idle_pss_kernel_overlay_net_on", "build_base",
}  # fmt: skip
IMAGES_FUSE_FIGURES = {
    "cold_fuse_overlay", "cold_host_fuse", "exec_true_fuse_overlay", "exec_true_host_fuse",
    "idle_pss_fuse_overlay", "idle_pss_host_fuse",
}  # fmt: skip


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 30)
def test_bench_images_quick(tmp_path: Path, base_image: Image) -> None:
    document = run_quick("bench_images.py", tmp_path / "images.json", "--images", str(base_image.path.parent))
    expected = IMAGES_FIGURES | (IMAGES_FUSE_FIGURES if os.geteuid() == 0 else set())
    check_figures(document, expected, "bench_images")
    assert document["figures"]["build_base"]["extra"]["source"] == "manifest"
    assert document["roots"]["kernel_overlay"]["layer"] == "kernel-overlay"
    steps = document["figures"]["cold_kernel_overlay"]["extra"]["steps_ms"]
    assert {"plan + dirs", "mounts + agent to ready", "first exec true"} <= set(steps)


#: bench_docker's figures: the agent against docker exec, cold start and resume.
DOCKER_FIGURES = {
    "bare_spawn", "asyncio_spawn", "exec_true_docker", "docker_exec_cli", "docker_exec_api",
    "docker_run_true", "cold_docker", "resume_docker",
}  # fmt: skip


SSH_FIGURES = {
    "raw_channel_builtin_true", "raw_channel_sh_true", "ssh_exec_true", "raw_channel_bin_true",
    "ssh_exec_argv_true", "raw_sftp_read_1m", "ssh_read_1m", "raw_sftp_write_1m", "ssh_write_1m",
    "raw_sftp_stat", "ssh_stat",
}  # fmt: skip


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 30)
def test_bench_docker_quick(tmp_path: Path, base_image: Image, dockerd: Dockerd) -> None:
    document = run_quick(
        "bench_docker.py", tmp_path / "docker.json", "--images", str(base_image.path.parent),
        "--docker-host", dockerd.host,
    )  # fmt: skip
    check_figures(document, DOCKER_FIGURES, "bench_docker")
    steps = document["figures"]["cold_docker"]["extra"]["steps_ms"]
    assert {"engine start", "agent connected, ready", "first exec true"} <= set(steps)


#: bench_browser's figures: agentbox's in-sandbox browser beside Playwright on the same Chromium.
BROWSER_FIGURES = {
    f"{side}_{figure}"
    for side in ("direct", "agentbox")
    for figure in ("first_action", "elements_snapshot", "click")
}


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 30)
def test_bench_browser_quick(tmp_path: Path, data_image: Image) -> None:
    document = run_quick(
        "bench_browser.py", tmp_path / "browser.json", "--images", str(data_image.path.parent)
    )
    check_figures(document, BROWSER_FIGURES, "bench_browser")


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 30)
def test_bench_ssh_quick(tmp_path: Path) -> None:
    document = run_quick("bench_ssh.py", tmp_path / "ssh.json")
    check_figures(document, SSH_FIGURES, "bench_ssh")
    assert document["figures"]["ssh_exec_true"]["target"]["kind"] == "ratio"


#: bench_kernels' figures: each language's start, memory and warm cell.
KERNEL_FIGURES = {
    f"{figure}_{language}" for figure in ("start", "memory", "cell") for language in ("python", "javascript")
}


@pytest.mark.timeout(QUICK_RUN_TIMEOUT + 30)
def test_bench_kernels_quick(tmp_path: Path, data_image: Image) -> None:
    document = run_quick(
        "bench_kernels.py", tmp_path / "kernels.json", "--images", str(data_image.path.parent)
    )
    check_figures(document, KERNEL_FIGURES, "bench_kernels")
