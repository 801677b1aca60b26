"""`aiayn serve`: the command line reaches the app (uvicorn.run replaced by a recorder)."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from aiayn.cli import main


def test_serve_command_builds_the_app_from_its_options(tiny_checkpoint, monkeypatch):
    from aiayn.serve.server import Server
    seen = {}
    monkeypatch.setattr(Server, "run", lambda self: seen.update(app=self.config.app, config=self.config, server=self))
    assert main(["serve", "--checkpoint", str(tiny_checkpoint), "--port", "8123", "--max-sentences", "3",
                 "--beam-size", "2", "--alpha", "0.3", "--max-len-b", "4", "--threads", "1", "--languages", "en-de",
                 "--no-repeat-ngram", "3"]) == 0
    assert seen["config"].host == "127.0.0.1" and seen["config"].port == 8123
    with TestClient(seen["app"], base_url="http://localhost") as client:
        health = client.get("/health").json()
        assert health["defaults"] == {"beam": 2, "alpha": 0.3, "no_repeat_ngram": 3}
        assert health["limits"]["max_sentences"] == 3
        assert health["model"]["name"] == tiny_checkpoint.name  # no --model-name: the file's name
        assert health["model"]["languages"] == {"source": "en", "target": "de"}
        r = client.post("/translate", json={"sentences": ["A dog."]})
        assert r.status_code == 200 and r.json()["beam"] == 2


def test_serve_takes_several_checkpoints_as_one_ensemble(tiny_checkpoint, monkeypatch):
    """As `aiayn translate --checkpoint A B`: the mean of their next-token probabilities. Two copies of
    one model translate as the model alone, with attention (of the ensemble's first model)."""
    from aiayn.serve.server import Server
    apps = []
    monkeypatch.setattr(Server, "run", lambda self: apps.append(self.config.app))
    request = {"sentences": ["A dog runs.", "Two men."], "beam": 2, "attention": True}
    answers = []
    for checkpoints in ([tiny_checkpoint], [tiny_checkpoint, tiny_checkpoint]):
        assert main(["serve", "--checkpoint", *map(str, checkpoints), "--threads", "1"]) == 0
        with TestClient(apps[-1], base_url="http://localhost") as client:
            answers.append((client.get("/health").json()["model"]["name"], client.post("/translate", json=request).json()))
    (one_name, one), (two_name, two) = answers
    assert one_name == tiny_checkpoint.name and two_name == f"{tiny_checkpoint.name}+{tiny_checkpoint.name}"
    assert two["translations"] == one["translations"] and len(two["attention"]) == 2
    assert two["attention"][0]["src_tokens"] == one["attention"][0]["src_tokens"]


def test_serve_bad_option_exits_2(tiny_checkpoint, capsys):
    assert main(["serve", "--checkpoint", str(tiny_checkpoint), "--batch-tokens", "0"]) == 2
    assert "--batch-tokens must be >= 1" in capsys.readouterr().err


def test_serve_options_reach_the_server_and_the_key_comes_from_the_environment(tiny_checkpoint, monkeypatch):
    from aiayn.serve.server import Server
    seen = {}
    monkeypatch.setattr(Server, "run", lambda self: seen.update(server=self))
    monkeypatch.setenv("AIAYN_API_KEY", "from-env")
    assert main(["serve", "--checkpoint", str(tiny_checkpoint), "--header-timeout-s", "2.5", "--keep-alive-s", "1",
                 "--shutdown-timeout-s", "3", "--allow-host", "a.example,b.example", "--threads", "1"]) == 0
    server = seen["server"]
    assert server.config.timeout_keep_alive == 1 and server.drain_s == 3
    assert server.config.http.__name__ == "GuardedH11Protocol"
    with TestClient(server.config.app, base_url="http://b.example") as client:
        assert client.post("/translate", json={"sentences": ["A dog."]}).status_code == 401
        r = client.post("/translate", json={"sentences": ["A dog."]}, headers={"authorization": "Bearer from-env"})
        assert r.status_code == 200
        assert client.get("/health", headers={"host": "localhost"}).status_code == 403


def test_serve_takes_how_its_model_decodes(tiny_checkpoint, monkeypatch):
    import aiayn.serve.app as app
    from aiayn.serve.server import Server
    seen = {}
    create = app.create_app
    monkeypatch.setattr(app, "create_app", lambda translator, cfg: seen.update(translator=translator) or create(translator, cfg))
    monkeypatch.setattr(Server, "run", lambda self: None)
    assert main(["serve", "--checkpoint", str(tiny_checkpoint), "--precision", "bf16", "--cuda-graphs",
                 "--threads", "1"]) == 0
    cfg = seen["translator"].cfg
    assert cfg.precision == "bf16" and cfg.cuda_graphs


def test_serve_on_a_taken_port_is_one_line_before_serving(tiny_checkpoint, capsys, caplog):
    """A port another service listens on: exit 2 with the address and the reason, and no banner
    saying it serves there (uvicorn alone would log its bind error after startup and exit 3)."""
    import socket
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with caplog.at_level("INFO"):
            assert main(["serve", "--checkpoint", str(tiny_checkpoint), "--port", str(port), "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--host 127.0.0.1 --port {port}: cannot listen on 127.0.0.1 port {port}" in err
    assert "choose another --port" in err and "Traceback" not in err
    assert not [r for r in caplog.records if r.getMessage().startswith("serving ")]


def test_serve_on_a_host_that_does_not_resolve_is_one_line(tiny_checkpoint, capsys):
    assert main(["serve", "--checkpoint", str(tiny_checkpoint), "--host", "no-such-host.invalid",
                 "--threads", "1"]) == 2
    assert "--host no-such-host.invalid --port 8000: cannot resolve the host" in capsys.readouterr().err


def test_listen_check_skips_an_address_the_machine_lacks_as_asyncio_does(monkeypatch):
    """A name resolving to an address the machine does not have (an IPv6 localhost where IPv6 is
    off) is listened on at its other addresses (asyncio's create_server skips it); only when no
    address is left is it an error."""
    import socket

    import pytest

    from aiayn.errors import UserError
    from aiayn.serve import server
    absent = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.1", 0))  # TEST-NET-1: never this machine's
    here = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0))
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [absent, here])
    server.check_listen("twofold.example", 0)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [absent])
    with pytest.raises(UserError, match="--host onlyabsent.example --port 0: cannot listen on 192.0.2.1 port 0"):
        server.check_listen("onlyabsent.example", 0)


def test_the_serving_line_names_the_port_bound(tiny_checkpoint, monkeypatch, caplog):
    """The "serving ... on http://HOST:PORT/" line is logged once the port is bound, with that port:
    with --port 0, the one the system chose (a client cannot reach port 0)."""
    import threading
    import time

    from aiayn.serve.server import Server
    seen, run = {}, Server.run
    monkeypatch.setattr(Server, "run", lambda self: seen.update(server=self))
    assert main(["serve", "--checkpoint", str(tiny_checkpoint), "--port", "0", "--threads", "1"]) == 0
    server = seen["server"]  # the command's server, run here in a thread
    thread = threading.Thread(target=run, args=(server,), daemon=True)
    with caplog.at_level("INFO", logger="aiayn.serve.server"):
        thread.start()
        deadline = time.monotonic() + 20
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        try:
            port = server.servers[0].sockets[0].getsockname()[1]
        finally:
            server.should_exit = True
            thread.join(20)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("serving ")]
    assert port != 0 and len(lines) == 1 and lines[0].startswith(f"serving {tiny_checkpoint} on http://127.0.0.1:{port}/ ")


def test_serve_names_the_environment_variable_of_a_key_no_client_can_send(tiny_checkpoint, monkeypatch, capsys):
    from aiayn.serve.server import Server
    monkeypatch.setattr(Server, "run", lambda self: None)  # (the service is not started)
    monkeypatch.setenv("AIAYN_API_KEY", "from-a-crlf-file\r")
    assert main(["serve", "--checkpoint", str(tiny_checkpoint)]) == 2
    err = capsys.readouterr().err
    assert "AIAYN_API_KEY" in err and "visible ASCII" in err and "from-a-crlf-file" not in err


@pytest.mark.parametrize("option, entry", [("--allow-host", "mt.example.org:443"), ("--allow-origin", "*")])
def test_a_bad_access_entry_reads_as_written(option, entry, capsys):
    """The error names the option; the words of its explanation stay words: "host" and "port" in it
    are not the --host and --port options (refused before any checkpoint is read)."""
    assert main(["serve", "--checkpoint", "unread.pt", option, entry]) == 2
    err = capsys.readouterr().err
    assert f"{option}: {entry!r} is not a" in err and "--host" not in err and "--port" not in err


@pytest.mark.parametrize("options, named", [
    (["--beam-size", "20"], ("--beam-size 20", "--max-beam 16")),
    (["--alpha", "2", "--max-alpha", "1"], ("--alpha 2", "--max-alpha 1")),
    (["--no-repeat-ngram", "3", "--max-no-repeat-ngram", "2"], ("--no-repeat-ngram 3", "--max-no-repeat-ngram 2")),
])
def test_serve_refuses_defaults_that_its_own_limits_refuse(tiny_checkpoint, monkeypatch, capsys, options, named):
    """A default over its cap would answer every request that leaves the field out 422, naming a field
    the client never sent: one line at start instead, naming both options."""
    from aiayn.serve.server import Server
    monkeypatch.setattr(Server, "run", lambda self: None)  # (the service is not started)
    assert main(["serve", "--checkpoint", str(tiny_checkpoint), *options]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in named), err


def test_serve_takes_defaults_at_their_limits(tiny_checkpoint, monkeypatch):
    from aiayn.serve.server import Server
    monkeypatch.setattr(Server, "run", lambda self: None)
    assert main(["serve", "--checkpoint", str(tiny_checkpoint), "--beam-size", "3", "--max-beam", "3", "--alpha", "1",
                 "--max-alpha", "1", "--max-no-repeat-ngram", "0", "--threads", "1"]) == 0
