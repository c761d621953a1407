"""The building blocks of every request schema (server/openai/protocol.py and the field groups beside
it): a strict model part that ignores unknown fields, and text that is valid Unicode."""
from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


def check_text(s: str) -> str:
    """Reject strings that are not valid Unicode (JSON `\\ud800` escapes decode to lone surrogates)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text is not valid UTF-8 (it holds an unpaired surrogate)") from None
    return s


Text = Annotated[str, AfterValidator(check_text)]


class Strict(BaseModel):
    """A request part: each field takes only the JSON type its schema names (body.py has made
    integral numbers ints); unknown fields are ignored."""
    model_config = ConfigDict(extra="ignore", strict=True)
