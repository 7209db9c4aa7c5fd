"""Offline builders of random-weight Qwen2 / Qwen2-VL / Qwen2.5-VL models for tests, demos and benchmarks.

Each build writes a standard Hugging Face folder (config, safetensors weights, generation config,
a byte-level BPE tokenizer trained on the spot, the Qwen chat template with tool support and, for
VL models, a Qwen2-VL image processor config) that loads with the Auto classes under
``HF_HUB_OFFLINE=1``. The same ``(arch, size, seed)`` always gives identical files.

Sizes: ``tiny`` (a few hundred thousand parameters, builds in well under a second) for unit tests;
``small`` (tens of millions) so that compute, not Python overhead, dominates a CPU benchmark.

Example::

    >>> from unsloth_rollout.testing.tiny import tiny_model_path
    >>> path = tiny_model_path("qwen2_5_vl")          # built once, then reused from the cache
    >>> model = AutoModelForImageTextToText.from_pretrained(path)

CLI::

    python -m unsloth_rollout.testing.tiny --arch qwen2_5_vl --size tiny --out DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import random
import shutil
import tempfile
from dataclasses import dataclass

from ..models.families import family_of

__all__ = ["ARCHES", "SIZES", "SPECIAL_TOKENS", "build_tiny_model", "chat_template", "tiny_model_path"]

ARCHES = ("qwen2", "qwen2_vl", "qwen2_5_vl")
SIZES = ("tiny", "small", "1.5b", "3b", "7b")  # the last three: real dimensions, for GPU benchmarks

# Bump when the files a build writes change, so stale cache entries are not reused.
_FORMAT_VERSION = "v3"  # bump whenever builds change, so stale caches are never reused
# Written last: its presence means the folder is complete.
_MARKER = "unsloth_rollout_tiny.json"

# Qwen2.5's added tokens, in Qwen's order (ids follow the BPE vocabulary, as 151643.. do in Qwen).
# (content, special): <tool_call> and later are plain added tokens, so decode() keeps them in text.
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)


@dataclass(frozen=True)
class _Spec:
    """Dimensions of one size; the vision fields are ignored for the text-only arch."""

    # BPE tokens before the added tokens. With the 22 added tokens this fills a multiple of 64, so the
    # model's vocab_size equals len(tokenizer) and no sampled id is undecodable.
    bpe_vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    mrope_section: tuple[int, int, int]  # sums to head_dim // 2
    init_range: float
    vision_depth: int
    vision_embed: int
    vision_heads: int
    vision_intermediate: int  # Qwen2.5-VL SwiGLU width (Qwen2-VL uses mlp_ratio 4)
    fullatt_blocks: tuple[int, ...]  # Qwen2.5-VL: blocks with full attention, the rest windowed
    min_pixels: int
    max_pixels: int
    model_vocab: int = 0  # 0: the tokenizer's size; real sizes keep Qwen's 151936-row embedding and lm_head
    tie_embeddings: bool = False  # as the real checkpoint of that size


_SPECS = {
    # head_dim 16; init 0.15: greedy continuations differ from prompt to prompt (0.1 repeats one token) while
    # fp32 noise in logprobs, engine vs a teacher-forced forward, stays ~5e-6 (0.2 reached 1.2e-5).
    "tiny": _Spec(
        bpe_vocab=746, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, mrope_section=(2, 3, 3),
        init_range=0.15, vision_depth=2, vision_embed=32, vision_heads=2, vision_intermediate=64,
        fullatt_blocks=(1,), min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16,
    ),
    # head_dim 64, proportions of Qwen2.5-0.5B; ~30M parameters; 0.02 init would make greedy repeat one token.
    "small": _Spec(
        bpe_vocab=2026, hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1408, mrope_section=(8, 12, 12),
        init_range=0.06, vision_depth=4, vision_embed=256, vision_heads=4, vision_intermediate=640,
        fullatt_blocks=(1, 3), min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64,
    ),
    # Real Qwen dimensions with random weights, to measure throughput and memory on a GPU (bf16 ~3/6/15 GB).
    # Qwen2.5-1.5B (text).
    "1.5b": _Spec(
        bpe_vocab=2026, hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, mrope_section=(16, 24, 24),
        init_range=0.02, vision_depth=32, vision_embed=1280, vision_heads=16, vision_intermediate=3420,
        fullatt_blocks=(7, 15, 23, 31), min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 1280, model_vocab=151936,
        tie_embeddings=True,
    ),
    # Qwen2.5-VL-3B.
    "3b": _Spec(
        bpe_vocab=2026, hidden=2048, layers=36, heads=16, kv_heads=2, intermediate=11008, mrope_section=(16, 24, 24),
        init_range=0.02, vision_depth=32, vision_embed=1280, vision_heads=16, vision_intermediate=3420,
        fullatt_blocks=(7, 15, 23, 31), min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 1280, model_vocab=151936,
        tie_embeddings=True,
    ),
    # Qwen2.5-VL-7B.
    "7b": _Spec(
        bpe_vocab=2026, hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, mrope_section=(16, 24, 24),
        init_range=0.02, vision_depth=32, vision_embed=1280, vision_heads=16, vision_intermediate=3420,
        fullatt_blocks=(7, 15, 23, 31), min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 1280, model_vocab=151936,
    ),
}  # fmt: skip

_SYSTEM_PROMPTS = {
    "qwen2": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "qwen2_vl": "You are a helpful assistant.",
    "qwen2_5_vl": "You are a helpful assistant.",
}

# Qwen2.5's Hermes-style tool template, with content rendered as Qwen2-VL does: a string, or a list of
# text / image / image_url / video parts (images become <|vision_start|><|image_pad|><|vision_end|>).
_CHAT_TEMPLATE = """\
{%- macro render_content(content, counts) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}
                {%- set counts.image = counts.image + 1 -%}
                {%- if add_vision_id -%}{{- 'Picture ' ~ counts.image ~ ': ' -}}{%- endif -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type == 'video' or 'video' in part -%}
                {%- set counts.video = counts.video + 1 -%}
                {%- if add_vision_id -%}{{- 'Video ' ~ counts.video ~ ': ' -}}{%- endif -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif 'text' in part -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set counts = namespace(image=0, video=0) -%}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- render_content(messages[0].content, counts) }}
    {%- else %}
        {{- '@@SYSTEM@@' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' }}
        {{- render_content(messages[0].content, counts) }}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\n@@SYSTEM@@<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {{- render_content(message.content, counts) }}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' }}
            {{- render_content(message.content, counts) }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- render_content(message.content, counts) }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def chat_template(arch: str = "qwen2_5_vl") -> str:
    """The Jinja chat template written into ``arch``'s folders (Qwen2.5 tools + Qwen2-VL image parts).

    Example::

        >>> "<tool_call>" in chat_template("qwen2")
        True
    """
    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
    return _CHAT_TEMPLATE.replace("@@SYSTEM@@", _SYSTEM_PROMPTS[arch])


def tiny_model_path(arch: str, size: str = "tiny", seed: int = 0) -> pathlib.Path:
    """Path of the cached build of ``(arch, size, seed)``, building it first if needed.

    Example::

        >>> tiny_model_path("qwen2").name
        'qwen2-tiny-s0-v3'
    """
    return build_tiny_model(arch, size, out=None, seed=seed)


def build_tiny_model(
    arch: str = "qwen2_5_vl", size: str = "tiny", out: str | os.PathLike | None = None, seed: int = 0
) -> pathlib.Path:
    """Write a random-weight ``arch`` model of ``size`` to ``out`` and return its path.

    ``out`` is created if needed and should be empty (or an earlier build, which is overwritten).
    With ``out=None`` the model goes to ``$UNSLOTH_ROLLOUT_CACHE/tiny/{arch}-{size}-s{seed}-v1``
    (default cache root ``~/.cache/unsloth_rollout``) and a complete earlier build is reused;
    builds there are atomic, so concurrent test workers are safe.

    Example::

        >>> path = build_tiny_model("qwen2", "tiny", out="/tmp/qwen2-tiny")
        >>> AutoModelForCausalLM.from_pretrained(path).num_parameters() > 0
        True
    """
    _check_arch_size(arch, size)
    if out is not None:
        path = pathlib.Path(out)
        path.mkdir(parents=True, exist_ok=True)
        _write_model(path, arch, size, seed)
        return path

    path = _cache_root() / "tiny" / f"{arch}-{size}-s{seed}-{_FORMAT_VERSION}"
    return cached_build(path, _MARKER, lambda tmp: _write_model(tmp, arch, size, seed))


def cached_build(path: pathlib.Path, marker: str, write) -> pathlib.Path:
    """``path`` if ``path/marker`` exists, else ``write(tmp)`` into a private folder renamed into place
    (atomic: concurrent test workers are safe). ``write`` must create ``marker`` last."""
    if (path / marker).is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
        if path.exists() and not (path / marker).is_file():
            shutil.rmtree(path, ignore_errors=True)  # a leftover from an interrupted non-atomic copy
        try:
            os.rename(tmp, path)
        except OSError:
            # Another process renamed its identical build into place first; keep that one.
            if not (path / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _check_arch_size(arch: str, size: str) -> None:
    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")


def _cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("UNSLOTH_ROLLOUT_CACHE") or "~/.cache/unsloth_rollout").expanduser()


def _write_model(path: pathlib.Path, arch: str, size: str, seed: int) -> None:
    # Heavy imports stay here so importing this module is cheap.
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

    spec = _SPECS[size]
    tokenizer = _build_tokenizer(spec.bpe_vocab)
    tokenizer.chat_template = chat_template(arch)
    ids = {text: tokenizer.convert_tokens_to_ids(text) for text, _ in SPECIAL_TOKENS}
    config = _model_config(arch, spec, ids, vocab_size=spec.model_vocab or _round_up(len(tokenizer), 64))

    vlm = family_of(arch).vlm
    auto_model = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    # Seed the global RNG (weights) and restore it, so building does not disturb the caller's randomness.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # Real sizes are built in bf16 (on a GPU when there is one): fp32 would double time and disk.
        big = spec.model_vocab > 0
        device = "cuda" if big and torch.cuda.is_available() else "cpu"
        with torch.device(device):
            model = auto_model.from_config(config, dtype=torch.bfloat16 if big else torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    )
    with _quiet_progress_bars():
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if vlm:
        _write_image_processor(path, arch, spec)

    meta = {
        "arch": arch,
        "size": size,
        "seed": seed,
        "version": _FORMAT_VERSION,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    (path / _MARKER).write_text(json.dumps(meta, indent=2) + "\n")


def _model_config(arch: str, spec: _Spec, ids: dict[str, int], vocab_size: int):
    from transformers import Qwen2_5_VLConfig, Qwen2Config, Qwen2VLConfig

    head_dim = spec.hidden // spec.heads
    dtype = "bfloat16" if spec.model_vocab else "float32"
    assert sum(spec.mrope_section) * 2 == head_dim, "mrope_section must cover head_dim / 2"
    text = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=32768,
        max_window_layers=spec.layers,
        initializer_range=spec.init_range,
        rms_norm_eps=1e-6,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=spec.tie_embeddings,
    )
    if arch == "qwen2":
        return Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **text, dtype=dtype)

    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": list(spec.mrope_section)}
    vision_common = dict(
        depth=spec.vision_depth,
        num_heads=spec.vision_heads,
        patch_size=14,
        temporal_patch_size=2,
        spatial_merge_size=2,
        initializer_range=spec.init_range,
    )
    if arch == "qwen2_vl":
        # Qwen2-VL: embed_dim is the ViT width, hidden_size the merger output (= text width).
        vision = dict(vision_common, embed_dim=spec.vision_embed, hidden_size=spec.hidden, mlp_ratio=4)
        config_cls = Qwen2VLConfig
    else:
        # Qwen2.5-VL: hidden_size is the ViT width, out_hidden_size the merger output (= text width).
        # window_size 56 px = 2x2 merged tokens, so windowed attention really partitions tiny images.
        vision = dict(
            vision_common,
            hidden_size=spec.vision_embed,
            intermediate_size=spec.vision_intermediate,
            out_hidden_size=spec.hidden,
            window_size=56,
            fullatt_block_indexes=list(spec.fullatt_blocks),
            tokens_per_second=2,
        )
        config_cls = Qwen2_5_VLConfig
    return config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=spec.tie_embeddings,
        dtype=dtype,
    )


def _write_image_processor(path: pathlib.Path, arch: str, spec: _Spec) -> None:
    from ..models.processor import QwenVLPilImageProcessor

    # Pass `size` rather than min/max_pixels: the PIL class mutates its class-level default dict otherwise.
    image_processor = QwenVLPilImageProcessor(
        size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )
    image_processor.save_pretrained(path)
    file = path / "preprocessor_config.json"
    data = json.loads(file.read_text())
    # Keys older transformers read, and the processor class a real Qwen folder names.
    data.update(
        min_pixels=spec.min_pixels,
        max_pixels=spec.max_pixels,
        image_processor_type="Qwen2VLImageProcessor",
        processor_class="Qwen2VLProcessor" if arch == "qwen2_vl" else "Qwen2_5_VLProcessor",
    )
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _build_tokenizer(bpe_vocab: int):
    """Train a Qwen2-style byte-level BPE on the built-in corpus and wrap it as ``Qwen2Tokenizer``."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import AddedToken
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    # Same normaliser / pre-tokeniser as Qwen2, so text splits (digits one by one, etc.) match real Qwen.
    backend = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    backend.train_from_iterator(_corpus(), trainer=trainer)
    model = json.loads(backend.to_str())["model"]
    vocab = dict(model["vocab"])
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    # Added tokens get fixed ids right after the BPE vocabulary, in Qwen's order.
    for text, _ in SPECIAL_TOKENS:
        vocab[text] = len(vocab)

    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        errors="replace",
        model_max_length=32768,
        split_special_tokens=False,
    )
    tokenizer.add_tokens(
        [AddedToken(text, special=special, normalized=False) for text, special in SPECIAL_TOKENS],
    )
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [text for text, special in SPECIAL_TOKENS if special and text != "<|endoftext|>"]}
    )
    return tokenizer


# Word pools for the training corpus: everyday English, arithmetic, JSON, reasoning and tool-call text.
_NAMES = "Alice Bob Carol Dave Eve Frank Grace Heidi Ivan Judy Mallory Oscar Peggy Trent Victor Wendy".split()
_NOUNS = (
    "cat dog bird fish horse cow sheep goat mouse lion tiger bear wolf fox rabbit frog apple banana orange "
    "grape lemon peach pear plum cherry melon bread cheese butter milk water coffee tea juice soup rice pasta "
    "house room door window table chair bed lamp clock phone computer screen keyboard book paper pen pencil "
    "letter box bag cup plate bowl spoon knife fork bottle car bus train plane boat bike road street bridge "
    "city town village country river lake sea ocean mountain hill forest tree flower grass leaf stone rock "
    "sun moon star sky cloud rain snow wind storm fire light shadow color shape circle square triangle line "
    "point number answer question problem solution reason idea plan story word sentence page image picture "
    "photo camera teacher student doctor farmer driver writer player friend family child parent brother "
    "sister morning evening night day week month year hour minute second school garden kitchen market"
).split()
_VERBS = (
    "walk run jump play read write draw paint sing dance cook eat drink sleep wake open close start stop "
    "help find lose keep give take make build break fix move carry push pull throw catch watch look see "
    "hear listen speak talk ask answer think learn teach count add subtract multiply divide check solve "
    "call return search describe explain compare choose follow visit travel"
).split()
_ADJECTIVES = (
    "red blue green yellow black white orange purple brown gray big small tall short long wide narrow "
    "happy sad quick slow bright dark warm cold hot soft hard new old young early late easy difficult "
    "simple clean quiet loud heavy light round flat sharp sweet"
).split()
_TOOLS = ("get_weather", "calculator", "search_web", "read_file", "send_email", "get_time", "lookup_word")
_CITIES = ("Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Cairo", "Lima", "Oslo", "Seoul")


def _inflect(verb: str) -> list[str]:
    stem = verb[:-1] if verb.endswith("e") else verb
    return [verb, verb + "s", stem + "ed", stem + "ing", stem + "er"]


def _word_forms() -> list[str]:
    """Derived forms (plurals, comparatives, capitals...) that give BPE enough distinct words to merge."""
    lines = [" ".join(_inflect(v) + [v.capitalize()]) for v in _VERBS]
    lines += [f"{n} {n}s {n}'s {n.capitalize()} {n.upper()} the {n} of the {n}s" for n in _NOUNS]
    lines += [f"{a} {a}er {a}est {a}ly {a}ness un{a} {a.capitalize()}" for a in _ADJECTIVES]
    return lines


def _corpus(lines: int = 1500) -> list[str]:
    """Deterministic training text: a few kinds of lines cycled with a fixed-seed RNG."""
    rng = random.Random(1234)
    pick = rng.choice
    out = _word_forms()
    for i in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        kind = i % 10
        if kind == 0:
            op = pick("+-*")
            result = a + b if op == "+" else a - b if op == "-" else a * b
            out.append(f"{a} {op} {b} = {result}")
        elif kind == 1:
            out.append(f"The {pick(_ADJECTIVES)} {pick(_NOUNS)} {pick(_inflect(pick(_VERBS)))} the {pick(_NOUNS)}.")
        elif kind == 2:
            out.append(f"{pick(_NAMES)} has {a} {pick(_NOUNS)}s and gives {b} to {pick(_NAMES)}. How many are left?")
        elif kind == 3:
            out.append(f"<think>\nLet me think. {a} + {b} = {a + b}.\n</think>\n<answer>{a + b}</answer>")
        elif kind == 4:
            args = json.dumps({"city": pick(_CITIES), "unit": pick(["celsius", "fahrenheit"])})
            out.append(f'<tool_call>\n{{"name": "{pick(_TOOLS)}", "arguments": {args}}}\n</tool_call>')
        elif kind == 5:
            record = {"id": i, "name": pick(_NAMES), "score": a / 10, "tags": [pick(_ADJECTIVES), pick(_NOUNS)]}
            out.append(json.dumps(record))
        elif kind == 6:
            out.append(f"Question: what is {a} plus {b}? Answer: the answer is {a + b}.")
        elif kind == 7:
            out.append(f"The image shows a {pick(_ADJECTIVES)} {pick(_NOUNS)} next to a {pick(_NOUNS)} in {pick(_CITIES)}.")
        elif kind == 8:
            out.append(f"<tool_response>\n{{\"temperature\": {b}, \"time\": \"{a % 24:02d}:{b % 60:02d}\"}}\n</tool_response>")
        else:
            out.append(f"Step {b % 9 + 1}: {pick(_VERBS)} the {pick(_NOUNS)}, then {pick(_VERBS)} it again.")
    return out


@contextlib.contextmanager
def _quiet_progress_bars():
    # save_pretrained draws a "Writing model shards" bar: noise in test logs and CLI output.
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--arch", choices=ARCHES, default="qwen2_5_vl")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--out", default=None, help="output folder (default: the shared cache)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build_tiny_model(args.arch, args.size, out=args.out, seed=args.seed)
    meta = json.loads((path / _MARKER).read_text())
    print(f"{path}\t{meta['num_parameters']:,} parameters")


if __name__ == "__main__":
    main()
