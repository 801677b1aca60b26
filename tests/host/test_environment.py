"""aiayn/host/environment.py: what a result records of the code, libraries and machine it came from."""
import shutil
import subprocess

import pytest
import torch

import aiayn
from aiayn.host.environment import NUMERIC_VARIABLES, cpu_model, environment, source_commit


def test_the_cpu_model_is_cpuinfos_model_name_with_its_numbers(tmp_path):
    """A virtual machine may name a Zen 4 and a Zen 5 alike ("AMD EPYC"): family and model tell them apart."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n")
    assert cpu_model(info) == "AMD EPYC 9R14 96-Core Processor"
    block = "processor\t: {0}\ncpu family\t: 26\nmodel\t\t: {1}\nmodel name\t: AMD EPYC\n\n"
    info.write_text(block.format(0, 2) + block.format(1, 9))
    assert cpu_model(info) == "AMD EPYC (family 26, model 2)"  # the first processor's
    assert cpu_model(tmp_path / "none")  # no /proc/cpuinfo: what platform says, never empty


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_commit_of_a_checkout_and_none_for_an_installed_copy(tmp_path):
    repo = tmp_path / "checkout"
    package = repo / "src" / "aiayn"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("__version__ = '0'\n")

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              check=True, capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    assert source_commit(package) is None  # not yet tracked: nothing of the checkout's is this package
    git("add", ".")
    git("commit", "-q", "-m", "first")
    head = git("rev-parse", "HEAD")
    assert source_commit(package) == {"commit": head, "modified": False}
    (package / "__init__.py").write_text("__version__ = '1'\n")
    assert source_commit(package) == {"commit": head, "modified": True}
    (package / "__init__.py").write_text("__version__ = '0'\n")
    (package / "new.py").write_text("")  # an untracked file changes no tracked code
    assert source_commit(package) == {"commit": head, "modified": False}
    installed = tmp_path / "site-packages" / "aiayn"  # a copy outside any checkout
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    assert source_commit(installed) is None


def test_the_environment_names_versions_machine_threads_and_only_its_variables(monkeypatch):
    monkeypatch.setenv("AIAYN_DENORMALS", "keep")
    monkeypatch.setenv("AIAYN_API_KEY", "not-recorded")
    env = environment()
    assert env["aiayn"] == aiayn.__version__ and env["torch"] == torch.__version__
    assert env["torch_threads"] == torch.get_num_threads() and env["cpu"] and env["logical_cpus"] >= 1
    assert env["variables"]["AIAYN_DENORMALS"] == "keep" and set(env["variables"]) <= set(NUMERIC_VARIABLES)
