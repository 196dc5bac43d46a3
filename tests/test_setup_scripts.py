"""The set-up and CI scripts: syntax, the README/CI command agreement, exit-5 handling, and the
set-up's progress lines."""

from __future__ import annotations

import subprocess

import pytest

CI_COMMAND = "bash scripts/setup.sh && bash scripts/test.sh"


@pytest.mark.parametrize("script", ["scripts/setup.sh", "scripts/test.sh", ".ci/run"])
def test_shell_scripts_parse(repo_root, script):
    proc = subprocess.run(["bash", "-n", str(repo_root / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_ci_runs_the_command_the_readme_shows(repo_root):
    ci = (repo_root / ".ci" / "run").read_text()
    readme = (repo_root / "README.md").read_text()
    commands = [line.strip() for line in ci.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-1] == CI_COMMAND
    assert CI_COMMAND in readme


def test_readme_documents_the_environment_variables(repo_root):
    readme = (repo_root / "README.md").read_text()
    for name in ("CKPT_SAVE_DIR", "SKIP_VALIDATION", "BUCKET_SIZE_GB", "MILES_LOG_DIR"):
        assert f"`{name}`" in readme, name


def test_test_script_fails_when_no_tests_are_collected(repo_root, tmp_path):
    (tmp_path / "test_nothing_here.py").write_text("x = 1\n")
    proc = subprocess.run(
        ["bash", str(repo_root / "scripts" / "test.sh"), str(tmp_path), "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "collected no tests" in proc.stderr


def test_setup_shows_progress_while_pip_runs(repo_root, tmp_path):
    """``scripts/setup.sh``'s long pip installs print, every ``SETUP_PROGRESS_S`` seconds, how long
    they have run, the packages pip has collected and its latest step; a failing install stops the
    set-up (exit 1) showing the log's last lines. (Sourced, the script only defines its functions.)"""
    script = f"""
source "{repo_root}/scripts/setup.sh"
LOG="{tmp_path}/setup.log"
: >"$LOG"
PROGRESS_S=1
fake_pip() {{ echo "Collecting torch"; echo "  Downloading ray-2.60.0.whl (70 MB)"; echo "Collecting ray"
              echo "Installing collected packages: a, b"; sleep 3; }}
with_progress weightsync fake_pip
echo "installed"
failing_pip() {{ echo "ERROR: No matching distribution found for nothing-such"; return 3; }}
with_progress weightsync failing_pip
echo "not reached"
"""
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    progress = [line for line in proc.stdout.splitlines() if "] weightsync: " in line]
    assert progress, proc.stdout
    assert any(line.endswith("2 packages collected; now: Installing collected packages: a, b") for line in progress), \
        progress
    assert "installed" in proc.stdout
    assert "not reached" not in proc.stdout
    assert "ERROR: command failed: failing_pip" in proc.stderr
    assert "No matching distribution found for nothing-such" in proc.stderr


def test_setup_installs_mooncakes_cuda_build_where_a_gpu_is(repo_root, tmp_path):
    """Where ``nvidia-smi`` lists a GPU, ``scripts/setup.sh`` replaces the non-CUDA Mooncake (the
    CPU set-up's, which cannot register GPU memory) with ``mooncake-transfer-engine-cuda13`` --
    both builds install the package ``mooncake``, so both are removed first -- once; without a GPU
    it leaves the non-CUDA build. (pip and the interpreter are fakes that record their calls.)"""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
    (bin_dir / "fakepy").write_text(f"""#!/bin/sh
if [ "$1" = "-m" ]; then echo "$*" >>"{tmp_path}/calls"; exit 0; fi
grep "^$3=" "{tmp_path}/versions" | cut -d= -f2
""")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    script = f"""
source "{repo_root}/scripts/setup.sh"
LOG="{tmp_path}/setup.log"; : >"$LOG"; : >"{tmp_path}/calls"
VPY="{bin_dir}/fakepy"
echo "mooncake-transfer-engine-non-cuda=0.3.13.post1" >"{tmp_path}/versions"
PATH="/usr/bin:/bin" install_mooncake_cuda
PATH="{bin_dir}:$PATH" install_mooncake_cuda
echo "mooncake-transfer-engine-cuda13=0.3.14" >"{tmp_path}/versions"
PATH="{bin_dir}:$PATH" install_mooncake_cuda
"""
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = [line.split("] ", 1)[1] for line in proc.stdout.splitlines() if "mooncake" in line]
    assert said[0].startswith("mooncake: the non-CUDA build (no GPU"), said
    assert said[1].startswith("mooncake: a GPU is present: installing mooncake-transfer-engine-cuda13==0.3.14"), said
    assert said[-1] == "mooncake: CUDA build 0.3.14 present", said
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == ["-m pip uninstall -y mooncake-transfer-engine-non-cuda mooncake-transfer-engine-cuda13",
                     "-m pip install --disable-pip-version-check --no-input --progress-bar off "
                     "mooncake-transfer-engine-cuda13==0.3.14"], calls
