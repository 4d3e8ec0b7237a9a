"""A JSON body sent without `Content-Type: application/json` (curl -d's form type, none,
text/plain) is served as JSON on the /v1 POST routes (issue 20); a body that is not JSON
is still refused. A real FastAPI app with a pydantic body and the middleware, over HTTP
(TestClient)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from flare.server.json_body import JsonContentType


class Body(BaseModel):
    model: str
    max_tokens: int


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()

    @app.post("/v1/echo")
    async def echo(body: Body) -> dict:
        return body.model_dump()

    app.add_middleware(JsonContentType)
    return TestClient(app)


@pytest.mark.parametrize("ctype", [None, "application/x-www-form-urlencoded", "text/plain",
                                   "application/json; charset=utf-8"])
def test_valid_json_is_accepted_whatever_the_content_type(client, ctype):
    headers = {"content-type": ctype} if ctype else {}
    r = client.post("/v1/echo", content=b'{"model": "m", "max_tokens": 3}', headers=headers)
    assert r.status_code == 200, r.text
    assert r.json() == {"model": "m", "max_tokens": 3}


def test_a_body_that_is_not_json_is_still_refused(client):
    r = client.post("/v1/echo", content=b"model=m&max_tokens=3",
                    headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 422
