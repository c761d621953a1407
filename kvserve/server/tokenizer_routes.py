"""the tokenizer endpoints (being built; installs nothing yet)."""


def install(app, state) -> None:
    return None
