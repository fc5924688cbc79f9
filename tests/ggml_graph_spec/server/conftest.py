"""The official `openai` client on each test module's own `server` fixture."""
from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c
