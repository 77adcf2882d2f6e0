"""glm-jax-serve's error answers: ``HTTPError`` (status, message, the field it names) and its OpenAI-style body."""

from __future__ import annotations

from .. import options as O
from ..experts.store import RamBudgetError

one_line = O.one_line


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param=None, code=None, type_="invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def request_refusal(job: dict, e) -> HTTPError:
    """The 400 of a request refused for its own reasons: the memory plan (RamBudgetError), or its grammar failing
    while the reply was generated (never a 200 with invalid text: the field the grammar came from)."""
    if isinstance(e, RamBudgetError):
        return memory_refusal(e)
    return HTTPError(400, one_line(e), param=job.get("grammar_param") or "response_format")


def memory_refusal(e: RamBudgetError) -> HTTPError:
    """A request the memory plan refused (Engine.memory_guard: its K/V growth does not fit the RAM budget)."""
    return HTTPError(400, one_line(e), code="insufficient_memory")
