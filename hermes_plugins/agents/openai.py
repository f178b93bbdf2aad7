"""The ``openai`` agent: any OpenAI-compatible Chat Completions endpoint.

Each turn sends the session-context prompt as the system message, the stored history (its user
and assistant messages with text) and the new message, and answers with the first choice's text.
A failing endpoint (a timeout, no connection, an HTTP error, an answer without text) gives a reply
that says so, and the detail goes to the log; the API key never appears in either.

Needs ``httpx`` (the ``serve`` extra); the core never imports this module.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

import httpx
from pydantic import Field

from hermes_core.config.schema import GatewayConfig
from hermes_core.config.values import Secs, Section
from hermes_core.domain.errors import ConfigError
from hermes_core.domain.models import SessionEntry
from hermes_core.gateway.agent_loading import agent_options
from hermes_core.gateway.agents import TurnRequest

__all__ = ["ERROR_PREFIX", "OpenAIAgent", "OpenAIAgents", "OpenAIOptions", "build"]

logger = logging.getLogger(__name__)

ERROR_PREFIX = "The agent could not answer:"
"""How every error reply begins; such replies are left out of the history sent later."""
_LOGGED_BODY = 300  # characters of a refused answer's body that the log shows


class OpenAIOptions(Section):
    """``agent.options`` of ``agent.use: openai``."""

    base_url: str = Field(
        "https://api.openai.com/v1", pattern=r"^https?://\S+$",
        description="an http:// or https:// URL, the endpoint's base (it ends before "
        "/chat/completions)",
    )  # fmt: skip
    model: str = Field(pattern=r"\S", description="the name of a model the endpoint serves")
    api_key_env: str | None = Field(
        "OPENAI_API_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="the name of the environment variable holding the API key, or null for an "
        "endpoint that takes none",
    )  # fmt: skip
    timeout_secs: Secs = 60.0
    temperature: float | None = Field(None, ge=0, le=2, description="a number from 0 to 2")
    max_tokens: int | None = Field(
        None, ge=1, le=10_000_000, description="a positive integer up to 10000000"
    )


def build(options: Mapping[str, Any], config: GatewayConfig) -> OpenAIAgents:
    """The ``openai`` builder: reads the options and the API key (a ConfigError naming the
    variable when it is not set)."""
    settings = agent_options(OpenAIOptions, options, config)
    key = None
    if settings.api_key_env is not None:
        key = os.environ.get(settings.api_key_env)
        if not key:
            source = config.source or "<defaults>"
            raise ConfigError(
                "agent.options.api_key_env",
                f"{source}: agent.options.api_key_env names {settings.api_key_env}, which is not "
                f"set in the environment; export {settings.api_key_env} with the endpoint's API "
                "key, or set api_key_env: null for an endpoint that takes none",
                source=source,
            )
    return OpenAIAgents(settings, key)


class OpenAIAgents:
    """The agent factory: one HTTP client shared by every lane's agent, closed by
    :meth:`aclose`."""

    def __init__(self, options: OpenAIOptions, api_key: str | None) -> None:
        self.options = options
        self.url = f"{options.base_url.rstrip('/')}/chat/completions"
        self._key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(headers=headers, timeout=options.timeout_secs)

    def __call__(self, entry: SessionEntry) -> OpenAIAgent:
        return OpenAIAgent(self)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.aclose()

    async def complete(self, messages: list[dict[str, str]]) -> str:
        """The model's answer to ``messages``, or an error reply starting with
        :data:`ERROR_PREFIX`."""
        body: dict[str, Any] = {"model": self.options.model, "messages": messages}
        if self.options.temperature is not None:
            body["temperature"] = self.options.temperature
        if self.options.max_tokens is not None:
            body["max_tokens"] = self.options.max_tokens
        timeout = self.options.timeout_secs
        try:
            response = await asyncio.wait_for(self._client.post(self.url, json=body), timeout)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            logger.warning("the model endpoint %s did not answer within %g s", self.url, timeout)
            return f"{ERROR_PREFIX} the model endpoint timed out after {timeout:g} s."
        except httpx.HTTPError as exc:
            logger.warning("the model endpoint %s could not be reached: %r", self.url, exc)
            return f"{ERROR_PREFIX} the model endpoint could not be reached."
        if not response.is_success:
            logger.warning(
                "the model endpoint %s answered HTTP %d: %s",
                self.url, response.status_code, self._hidden(response.text[:_LOGGED_BODY]),
            )  # fmt: skip
            return f"{ERROR_PREFIX} the model endpoint answered HTTP {response.status_code}."
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, LookupError, TypeError):
            content = None
        if not isinstance(content, str) or not content.strip():
            logger.warning(
                "the model endpoint %s gave no text in choices[0].message.content: %s",
                self.url, self._hidden(response.text[:_LOGGED_BODY]),
            )  # fmt: skip
            return f"{ERROR_PREFIX} the model endpoint's answer held no text."
        return content

    def _hidden(self, text: str) -> str:
        """``text`` with the API key replaced, should the endpoint echo it."""
        return text.replace(self._key, "***") if self._key else text


class OpenAIAgent:
    """One lane's agent. It keeps nothing between turns: each turn reads the stored history,
    which holds every message of the session, resumed and queued turns' included."""

    def __init__(self, agents: OpenAIAgents) -> None:
        self._agents = agents

    async def run_turn(self, request: TurnRequest) -> str | None:
        prompt = request.system_prompt
        messages = [{"role": "system", "content": prompt}] if prompt else []
        for message in await request.history():
            role, content = message.get("role"), message.get("content")
            if role not in ("user", "assistant") or not isinstance(content, str):
                continue
            if role == "assistant" and content.startswith(ERROR_PREFIX):
                continue
            messages.append({"role": role, "content": content})
        if request.message:
            messages.append({"role": "user", "content": request.message})
        return await self._agents.complete(messages)

    async def interrupt(self) -> bool:
        return False

    def soft_release(self) -> None:
        return

    def cleanup(self) -> None:
        return
