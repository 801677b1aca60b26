"""POST /translate with "prefix": each translation begins with its sentence's prefix."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from aiayn.serve.app import create_app

from .conftest import LOCAL, SERVE


@pytest.fixture(scope="module")
def client(translator):
    with TestClient(create_app(translator, SERVE), base_url=LOCAL) as c:
        yield c


def test_prefix_field(client, translator):
    sents = ["A man is riding a bicycle.", "Two dogs play in the snow."]
    r = client.post("/translate", json={"sentences": sents, "prefix": ["Ein Mann fährt", ""], "beam": 2})
    assert r.status_code == 200, r.text
    out = r.json()["translations"]
    assert out[0].startswith("Ein Mann fährt")
    assert out[1] == client.post("/translate", json={"sentences": sents[1:], "beam": 2}).json()["translations"][0]
    r = client.post("/translate", json={"sentences": sents, "prefix": ["Ein"]})
    assert r.status_code == 422 and "1 prefixes for 2 sentences" in r.json()["error"]
