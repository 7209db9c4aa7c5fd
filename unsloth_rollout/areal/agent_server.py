"""Agent workflows on the unsloth backend: the engine serves the agent, in process, over loopback HTTP.

An *agent workflow* is any object with ``async def run(data, **extra_kwargs)`` that talks to an
OpenAI-compatible endpoint with the plain ``openai`` SDK (``base_url``, ``api_key``, ``http_client``
in ``extra_kwargs``; or ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` in ``subproc`` mode) and returns its
reward (a float, or ``{completion_id: reward}``). On remote engines AReaL runs it behind its proxy
workers. Here:

- ``AgentServer``: the project's own server (``unsloth_rollout.serve.create_app``) over the live
  RolloutEngine, on 127.0.0.1, with per-episode *sessions*: a session is an API key; every chat
  completion made with it is recorded the way AReaL's proxy records it -- an
  ``InteractionWithTokenLogpReward`` (messages, the completion, the prompt's token ids as the model ran
  them, output ids, logprobs, weight versions, and for VLMs the exact pixel values) in an
  ``InteractionCache``. Other keys are served unrecorded; a finished session's key is refused (401).
- ``UnslothAgentWorkflow``: the ``RolloutWorkflow`` AReaL's executor runs per episode: open a session,
  run the agent unchanged, hand its reward to the session's interactions (AReaL's rules: a float goes
  to the last completion, a dict by id; turn discount), export them (``individual`` or, with
  ``chat_template_type: concat``, ``concat`` style) as the trajectory. An agent that fails (raises, a
  400 from the server such as a context overflow, a bad reward, a timeout) ends only its own episode:
  its recorded completions are kept with reward 0 and the error is logged; an episode without any
  completion is rejected (None).

``UnslothInferenceEngine`` resolves agent workflows to ``UnslothAgentWorkflow`` (``install()`` /
the source patch keep ``PPOTrainer`` from starting proxy workers), so::

    trainer.train(workflow=MyAgent(), workflow_kwargs=None)   # rollout.backend: "unsloth:d1"

Example (without a trainer)::

    server = AgentServer(rollout_engine, tool_call_parser="qwen")
    session = server.start_session()
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key=session.key)
    ...   # the agent's requests
    server.end_session(session.key).cache.export_interactions("individual", reward_discount=1.0)
"""

from __future__ import annotations

import asyncio
import numbers
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from areal.api import RolloutWorkflow
from areal.experimental.openai.cache import InteractionCache
from areal.experimental.openai.types import InteractionWithTokenLogpReward
from areal.utils import stats_tracker

from ..logs import get_logger
from . import compat
from .finite_rewards import finite_reward
from .openai_compat import UnslothModelResponse, project_tool_parser

logger = get_logger("unsloth_rollout.areal.agent_server")

SESSION_KEY_PREFIX = "areal-session-"
IN_PROCESS = "unsloth-in-process"  # the proxy_addr AReaL's workflow resolution gets: the engine serves itself


@dataclass
class AgentSession:
    """One episode's recorded completions (an InteractionCache), addressed by its API key."""

    key: str
    cache: InteractionCache = field(default_factory=InteractionCache)
    closed: bool = False
    started: float = field(default_factory=time.time)
    tokenizer: Any = None
    dropped: int = 0  # completions that finished after the session ended
    model: str | None = None  # the adapter its requests run on (None: the live policy), set per request
    chat_template_type: str = "hf"  # "concat": each turn continues the earlier turns' exact tokens

    def prompt_ids_for(self, rid: str, req):
        """For a "concat" session: ``prompt_ids(messages, tools, kwargs)`` building the prompt as ArealOpenAI's
        concat mode does (the parent completion's tokens, then the new messages' tokens); None for "hf"."""
        if self.chat_template_type != "concat":
            return None
        from areal.experimental.openai.client import concat_prompt_token_ids_with_parent

        ensure_message_dict_list = compat.ENSURE_MESSAGE_DICT_LIST.get()

        def build(tok_messages, tools, kwargs):
            interaction = InteractionWithTokenLogpReward(
                messages=ensure_message_dict_list("messages", list(req.messages)), chat_template_type="concat")
            self.cache[rid] = interaction  # finds its parent (the longest recorded prefix of these messages)
            parent = interaction.parent
            rest = tok_messages[len(parent.messages) + len(parent.output_message_list):] if parent else tok_messages
            return concat_prompt_token_ids_with_parent(rest, parent, self.tokenizer, tools=tools,
                                                       extra_body={"chat_template_kwargs": kwargs})

        return build

    def discard(self, rid: str) -> None:
        """Forget a request that was not recorded (its placeholder in a concat session)."""
        inter = self.cache.get(rid)
        if inter is not None and inter.model_response is None:
            del self.cache[rid]

    def record(self, rid: str, req, prep, outs, body: dict) -> None:
        """Store one chat completion as AReaL's proxy does (called by the server before it answers)."""
        from openai.types.chat import ChatCompletion

        if self.closed:
            self.dropped += 1
            logger.warning(f"session {self.key[:22]}...: a completion finished after the episode ended; not recorded")
            return
        (out,) = outs
        choice = body["choices"][0]
        completion = ChatCompletion.model_validate(body)
        mm = None
        if out.pixel_values is not None:
            mm = {"pixel_values": out.pixel_values, "image_grid_thw": out.image_grid_thw}
        response = UnslothModelResponse(
            input_tokens=list(out.prompt_ids), output_tokens=list(out.output_ids),
            output_logprobs=[float(x) for x in out.output_logprobs],
            output_versions=[int(v) for v in out.output_versions],
            stop_reason=choice["finish_reason"] if choice["finish_reason"] in ("stop", "length", "tool_calls")
            else "abort",
            tokenizer=self.tokenizer, latency=float(out.metrics.get("latency_s") or 0.0),
            ttft=float(out.metrics.get("ttft_s") or 0.0), multi_modal_input=mm)
        interaction = self.cache.get(rid)  # concat: created with the prompt
        if interaction is None:
            interaction = InteractionWithTokenLogpReward(
                messages=compat.ENSURE_MESSAGE_DICT_LIST.get()("messages", list(req.messages)),
                chat_template_type="hf")
        interaction.model_response = response
        interaction.completion = completion
        # The assistant message exactly as the agent's SDK reads it (what it appends to its conversation).
        interaction.output_message_list = [completion.choices[0].message.model_dump(exclude_none=True)]
        if rid not in self.cache:
            self.cache[rid] = interaction


class AgentServer:
    """The project's OpenAI-compatible server over ``rollout_engine``, on loopback, with recorded sessions.

    Args:
        rollout_engine: the live RolloutEngine (the trainer's policy).
        tool_call_parser: AReaL's parser name (``agent.tool_call_parser``: qwen, hermes, llama3_json, ...).
        host, port: where to listen (port 0: a free port).
        served_model_name: the name ``/v1/models`` reports (session requests may name any model).
        served_adapter: ``() -> adapter name | None``: what session requests run on (a trainer in another
            process that ships versioned LoRA adapters); default None, the live policy (colocated training).
        chat_template_type: AReaL's ``agent.chat_template_type``: "hf" (each request rendered by the chat
            template) or "concat" (each turn continues the previous turn's exact tokens; needed for the
            "concat" export style, one trajectory per conversation).
    """

    def __init__(self, rollout_engine, *, tool_call_parser: str = "qwen", host: str = "127.0.0.1", port: int = 0,
                 served_model_name: str = "policy", served_adapter=None, chat_template_type: str = "hf"):
        if chat_template_type not in ("hf", "concat"):
            raise ValueError(f"chat_template_type must be 'hf' or 'concat', got {chat_template_type!r}")
        self.chat_template_type = chat_template_type
        from ..serve import create_app, serve_in_thread

        self.engine = rollout_engine
        self._served_adapter = served_adapter
        self.app = create_app(rollout_engine, served_model_name=served_model_name,
                              tool_call_parser=project_tool_parser(tool_call_parser))
        self.app.state.server.sessions = self
        self._sessions: dict[str, AgentSession] = {}
        self._lock = threading.Lock()
        # Agents keep connections open across a training step (seconds to minutes without a request): a short
        # keep-alive would close them under the client, which then fails its next request ("Connection error").
        self._server = serve_in_thread(self.app, host=host, port=port, timeout_keep_alive=3600)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.host, self.port = host, port
        self.base_url = f"http://{host}:{port}/v1"

    # ------------------------------------------------------------------ sessions
    def start_session(self) -> AgentSession:
        session = AgentSession(SESSION_KEY_PREFIX + secrets.token_hex(16), tokenizer=self.engine.tokenizer,
                               chat_template_type=self.chat_template_type)
        with self._lock:
            self._sessions[session.key] = session
        return session

    def end_session(self, key: str) -> AgentSession:
        """Close a session (its key is refused from now on) and return it with its recorded completions."""
        with self._lock:
            session = self._sessions.pop(key)
        session.closed = True
        return session

    def lookup(self, raw_request) -> AgentSession | None:
        """The session a request's API key opens; None for other keys; 401 for an unknown or ended session."""
        from ..serve.protocol import APIError

        auth = raw_request.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else raw_request.headers.get("x-api-key", "")
        if not key.startswith(SESSION_KEY_PREFIX):
            return None
        with self._lock:
            session = self._sessions.get(key)
        if session is None:
            raise APIError("unknown or finished session: this episode has ended (its API key is no longer valid)",
                           401)
        session.model = self._served_adapter() if self._served_adapter is not None else None
        return session

    @property
    def num_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def close(self) -> None:
        """Stop the HTTP server (the engine is not touched)."""
        self._server.should_exit = True
        thread = getattr(self._server, "thread", None)
        if thread is not None:
            thread.join(timeout=10)


class UnslothAgentWorkflow(RolloutWorkflow):
    """Runs an OpenAI-SDK agent (``async def run(data, **extra_kwargs)``) as one episode on ``AgentServer``.

    Args:
        agent: the agent object (its ``run`` must be a coroutine function).
        server: an ``AgentServer``, or a callable returning one (started on first use).
        mode: "inline" (``run(data, base_url=..., api_key=..., http_client=...)`` on the rollout loop) or
            "subproc" (``run(data)`` in a worker process with ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``).
        discount: AReaL's turn discount (reward propagated backwards over the episode's completions).
        export_style: "individual" (each completion one trajectory, as AReaL's default) or "concat" (one per
            conversation; the server must record with ``chat_template_type="concat"``).
        timeout_s: an episode still running after this long is ended (AReaL's ``agent.session_timeout_seconds``);
            its completions are kept with reward 0. None: no limit.
    """

    def __init__(self, agent: Any, server, *, mode: str = "inline", discount: float = 1.0,
                 export_style: str = "individual", subproc_max_workers: int = 4, timeout_s: float | None = None):
        if mode not in ("inline", "subproc"):
            raise ValueError(f"agent.mode: the unsloth backend runs agents 'inline' or 'subproc', got {mode!r}"
                             + (" (online mode needs AReaL's proxy gateway)" if mode == "online" else ""))
        if export_style not in ("individual", "concat"):
            raise ValueError(f"agent.export_style must be 'individual' or 'concat', got {export_style!r}")
        run = getattr(agent, "run", None)
        if run is None or not callable(run):
            raise TypeError(f"Agent must have a callable 'run' method; {type(agent).__name__} has none")
        if not asyncio.iscoroutinefunction(run):
            raise TypeError(f"Agent's 'run' method must be an async function; {type(agent).__name__}.run is not")
        self.agent = agent
        self._server = server
        self.mode = mode
        self.discount = float(discount)
        self.export_style = export_style
        self.subproc_max_workers = subproc_max_workers
        self.timeout_s = timeout_s

    @property
    def server(self) -> AgentServer:
        if not isinstance(self._server, AgentServer):
            self._server = self._server()
        if self.export_style == "concat" and self._server.chat_template_type != "concat":
            raise ValueError("agent.export_style 'concat' needs agent.chat_template_type 'concat' (each turn "
                             "recorded as a continuation of the previous turn's tokens)")
        return self._server

    async def _run_agent(self, session: AgentSession, data: dict):
        server = self.server
        if self.mode == "inline":
            from areal.infra import workflow_context

            try:
                http_client = await workflow_context.get_httpx_client()
            except Exception:  # outside AReaL's executor (no workflow context): the SDK's own client
                http_client = None
            kwargs = {"base_url": server.base_url, "api_key": session.key}
            if http_client is not None:
                kwargs["http_client"] = http_client
            return await self.agent.run(data, **kwargs)
        env = {"OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": session.key}
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(compat.PROXY_EXECUTOR.get()(max_workers=self.subproc_max_workers),
                                          compat.PROXY_WRAP_RUN.get(),
                                          self.agent, data, env)

    @staticmethod
    def _assign(cache: InteractionCache, rewards) -> None:
        if isinstance(rewards, dict):
            unknown = [k for k in rewards if k not in cache]
            if unknown:
                raise ValueError(f"the agent's reward dict names completion id(s) {unknown[:3]} this episode did "
                                 f"not make (ids are chat.completions.create(...).id)")
            for cid, r in rewards.items():
                if not isinstance(r, numbers.Real) or isinstance(r, bool):
                    raise ValueError(f"reward for {cid!r} must be a number, got {type(r).__name__}")
                cache.set_reward(cid, finite_reward(r, f"the agent's reward for {cid!r}"))
        elif isinstance(rewards, numbers.Real) and not isinstance(rewards, bool):
            # Before the turn discount spreads it over the episode's completions.
            cache.set_last_reward(finite_reward(rewards, "the agent's run()"))
        else:
            raise ValueError(f"the agent's run() must return a float or {{completion_id: float}}, "
                             f"got {type(rewards).__name__}")

    async def arun_episode(self, engine, data: dict[str, Any]) -> dict[str, InteractionWithTokenLogpReward] | None:
        session = self.server.start_session()
        error: BaseException | None = None
        rewards = None
        try:
            rewards = await asyncio.wait_for(self._run_agent(session, data), self.timeout_s)
        except asyncio.TimeoutError:
            error = TimeoutError(f"the episode ran past {self.timeout_s} s (agent.session_timeout_seconds)")
        except Exception as exc:  # the agent's own failure ends its episode, not the run
            error = exc
        finally:
            self.server.end_session(session.key)
        cache = session.cache
        if error is None and not cache:
            logger.warning("agent episode made no chat completion; trajectory rejected")
            return None
        if error is None:
            try:
                self._assign(cache, rewards)
            except ValueError as exc:
                error = exc
        scope = _stat_scope()
        if error is not None:
            logger.warning(f"agent episode failed ({type(error).__name__}: {error}); "
                           + (f"its {len(cache)} completion(s) are kept with reward 0" if cache
                              else "it made no completion: trajectory rejected"))
            stats_tracker.get(scope).scalar(agent_error=1.0)
            if not cache:
                return None
            for cid in cache:
                cache.set_reward(cid, 0.0)
        interactions = cache.export_interactions(style=self.export_style, reward_discount=self.discount)
        last = next(reversed(interactions))
        stats_tracker.get(scope).scalar(reward=interactions[last].reward, turns=float(len(cache)))
        return interactions


def _stat_scope() -> str:
    try:
        from areal.infra import workflow_context

        return workflow_context.stat_scope()
    except Exception:
        return "rollout"
