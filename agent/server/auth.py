"""The API key that guards the agent's ways in, when one is configured."""

import hmac

from fastapi import HTTPException

from agent.config import Settings


def check_api_key(settings: Settings, authorization: str | None) -> None:
    """401 unless `Authorization: Bearer <API_KEY>` matches (when an API key is configured)."""
    if settings.api_key is None:
        return
    expected = f"Bearer {settings.api_key.get_secret_value()}"
    if authorization is None or not hmac.compare_digest(authorization.encode(), expected.encode()):
        raise HTTPException(401, "missing or wrong API key", headers={"WWW-Authenticate": "Bearer"})
