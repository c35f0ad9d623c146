"""Text ⇄ token ids, and chat templates.

One ``Tokenizer`` wraps a ``tokenizers.Tokenizer`` whatever it was built
from: a Hugging Face ``tokenizer.json``, the vocabulary stored in a GGUF file,
or the small built-in byte-level vocabulary of the ``tiny-random`` model.
BOS handling and chat templates live here, not in the wrapped object, so the
three sources behave the same.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cache
from os import PathLike
from typing import Any, NoReturn, final

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from pdtrio.engine.api import PromptRejected
from pdtrio.engine.tool_prompt import messages_for_plain_template

__all__ = ["Tokenizer", "tiny_tokenizer"]

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre values (llama.cpp's names) → how HF's tokenizer.json splits words.
_GPT2_PRE = frozenset({"default", "gpt-2", "gpt2", "mpt", "olmo", "jais"})
_DIGITS_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"})
_LLAMA3_PRE = frozenset({"llama3", "llama-bpe", "dbrx", "smaug-bpe"})
_QWEN2_PRE = frozenset({"qwen2", "stablelm2"})

_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@final
class Tokenizer:
    """A model's tokenizer: encode, decode, chat template, special ids.

    Thread-safe: the wrapped ``tokenizers.Tokenizer`` is, and nothing here
    mutates after construction.  Build one with ``from_files``,
    ``from_gguf_metadata`` or ``tiny_tokenizer()``.
    """

    __slots__ = (
        "_add_bos",
        "_bos_token",
        "_bos_token_id",
        "_eos_token",
        "_eos_token_ids",
        "_special_ids",
        "_template",
        "_template_error",
        "_template_knows_tools",
        "_tok",
        "_vocab_size",
    )

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        add_bos: bool,
        chat_template: str | None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._tok = tok
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._bos_token_id = None if bos_token is None else tok.token_to_id(bos_token)
        if bos_token is not None and self._bos_token_id is None:
            raise ValueError(f"BOS token {bos_token!r} is not in the vocabulary")
        self._add_bos = add_bos and self._bos_token_id is not None
        eos_ids = set(extra_eos_token_ids)
        if eos_token is not None:
            eos_id = tok.token_to_id(eos_token)
            if eos_id is None:
                raise ValueError(f"EOS token {eos_token!r} is not in the vocabulary")
            eos_ids.add(eos_id)
        self._eos_token_ids = frozenset(eos_ids)
        self._vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(
            i for i, added in tok.get_added_tokens_decoder().items() if added.special
        )
        self._template: jinja2.Template | None = None
        self._template_error: str | None = None
        # whether the template renders tools and tool calls itself (else they are
        # written into the messages for it: see tool_prompt)
        self._template_knows_tools = False
        if chat_template is None:
            self._template_error = "this model has no chat template"
        else:
            try:
                environment = _chat_template_environment()
                self._template = environment.from_string(chat_template)
                variables = jinja2.meta.find_undeclared_variables(environment.parse(chat_template))
                self._template_knows_tools = "tools" in variables and "tool_calls" in chat_template
            except jinja2.TemplateError as exc:
                self._template_error = f"the model's chat template does not compile: {exc}"

    # ------------------------------------------------------------------ builders

    @classmethod
    def from_files(
        cls,
        tokenizer_json_path: str | PathLike[str],
        tokenizer_config: Mapping[str, Any],
        *,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> Tokenizer:
        """From a Hugging Face ``tokenizer.json`` and the parsed ``tokenizer_config.json``.

        ``extra_eos_token_ids`` is for ``generation_config.json``'s
        ``eos_token_id`` (an int or a list), which often names more stop ids
        than ``eos_token``.
        """
        tok = tokenizers.Tokenizer.from_file(str(tokenizer_json_path))
        template = tokenizer_config.get("chat_template")
        if isinstance(template, list):  # the older named-templates form
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        return cls(
            tok,
            bos_token=_token_content(tokenizer_config.get("bos_token")),
            eos_token=_token_content(tokenizer_config.get("eos_token")),
            add_bos=bool(tokenizer_config.get("add_bos_token", False)),
            chat_template=template,
            extra_eos_token_ids=extra_eos_token_ids,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """From a GGUF file's ``tokenizer.*`` key/values (plain Python values).

        Only ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) is supported.
        """
        model = _as_str(metadata.get("tokenizer.ggml.model", ""))
        if model != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')"
            )
        tokens = [_as_str(t) for t in metadata["tokenizer.ggml.tokens"]]
        merges_raw = metadata.get("tokenizer.ggml.merges") or []
        types_raw = metadata.get("tokenizer.ggml.token_type")
        token_types = [1] * len(tokens) if types_raw is None else [int(t) for t in types_raw]
        pre = _as_str(metadata.get("tokenizer.ggml.pre", "default"))

        vocab = {token: i for i, token in enumerate(tokens)}
        merges: list[tuple[str, str]] = []
        for merge in merges_raw:
            left, sep, right = _as_str(merge).partition(" ")
            if not sep:
                raise ValueError(f"malformed GGUF merge {merge!r}")
            merges.append((left, right))

        tok = tokenizers.Tokenizer(
            models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _LLAMA3_PRE)
        )
        _set_byte_level_pipeline(tok, pre)
        added = [
            AddedToken(tokens[i], special=t == _TOKEN_TYPE_CONTROL, normalized=False)
            for i, t in enumerate(token_types)
            if t in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
        ]
        tok.add_special_tokens([a for a in added if a.special])
        tok.add_tokens([a for a in added if not a.special])

        def token_at(key: str) -> str | None:
            value = metadata.get(key)
            if value is None or not 0 <= int(value) < len(tokens):
                return None
            return tokens[int(value)]

        extra_eos = [
            int(metadata[key])
            for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if metadata.get(key) is not None and 0 <= int(metadata[key]) < len(tokens)
        ]
        template = metadata.get("tokenizer.chat_template")
        return cls(
            tok,
            bos_token=token_at("tokenizer.ggml.bos_token_id"),
            eos_token=token_at("tokenizer.ggml.eos_token_id"),
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=None if template is None else _as_str(template),
            extra_eos_token_ids=extra_eos,
        )

    # ------------------------------------------------------------------ queries

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation (EOS, end-of-turn)."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of special tokens: never shown when decoding with ``skip_special_tokens``."""
        return self._special_ids

    def backend_json(self) -> str:
        """The wrapped tokenizer as Hugging Face ``tokenizer.json`` text (what grammar
        libraries read the vocabulary from)."""
        text: str = self._tok.to_str()
        return text

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (byte-level form, e.g. ``"Ġthe"``); None if out of range."""
        return self._tok.id_to_token(token_id)

    # ------------------------------------------------------------------ text

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their single ids."""
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            ids = self._with_bos(ids)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; an incomplete UTF-8 sequence decodes to U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[tuple[str, str]],
        *,
        add_generation_prompt: bool = True,
        tools_json: str = "",
        message_extras: Sequence[str] = (),
    ) -> str:
        """Render ``(role, content)`` messages with the model's chat template.

        ``tools_json`` (the tools, OpenAI's shape) and ``message_extras`` (per
        message, JSON of its ``tool_calls`` or ``tool_call_id``; "" for none) go
        to a template that renders tools; another gets them written into the
        messages.

        Raises PromptRejected when the model has no template or the template
        refuses the conversation (``raise_exception``, undefined values, ...).
        """
        if self._template is None:
            raise PromptRejected(self._template_error or "no chat template", param="messages")
        rendered: list[dict[str, Any]] = [
            {"role": role, "content": content} for role, content in messages
        ]
        for message, extras in zip(rendered, message_extras, strict=False):
            if extras:
                message.update(json.loads(extras))
        tools = json.loads(tools_json) if tools_json else None
        if (tools or any(message_extras)) and not self._template_knows_tools:
            rendered, tools = messages_for_plain_template(rendered, tools), None
        context: dict[str, Any] = {
            "messages": rendered,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
            "documents": None,
        }
        if self._bos_token is not None:
            context["bos_token"] = self._bos_token
        if self._eos_token is not None:
            context["eos_token"] = self._eos_token
        try:
            return self._template.render(context)
        except jinja2.TemplateError as exc:
            raise PromptRejected(f"chat template error: {exc}", param="messages") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # Python errors raised from inside the template's expressions.
            raise PromptRejected(f"chat template error: {exc}", param="messages") from exc

    def encode_chat(
        self,
        messages: Sequence[tuple[str, str]],
        *,
        add_generation_prompt: bool = True,
        tools_json: str = "",
        message_extras: Sequence[str] = (),
    ) -> list[int]:
        """Token ids of the rendered chat; BOS is added only if the template did not."""
        text = self.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools_json=tools_json,
            message_extras=message_extras,
        )
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return self._with_bos(ids)

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self._add_bos and (not ids or ids[0] != self._bos_token_id):
            assert self._bos_token_id is not None
            return [self._bos_token_id, *ids]
        return ids

    def __repr__(self) -> str:
        return (
            f"<Tokenizer vocab_size={self._vocab_size} bos={self._bos_token!r} "
            f"eos_ids={sorted(self._eos_token_ids)}>"
        )


# ---------------------------------------------------------------------- tiny

# Merges of the built-in tiny vocabulary, in rank order (byte-level symbols:
# "Ġ" is a space, "Ċ" a newline).
_TINY_MERGES: tuple[tuple[str, str], ...] = (
    ("Ġ", "t"), ("h", "e"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"), ("r", "e"),
    ("Ġ", "a"), ("Ġt", "he"), ("Ġ", "s"), ("e", "n"), ("a", "t"), ("o", "r"), ("Ġ", "w"),
    ("i", "s"), ("e", "s"), ("Ġ", "o"), ("Ġ", "c"), ("in", "g"), ("Ġ", "b"), ("e", "d"),
    ("Ġ", "f"), ("a", "r"), ("Ġ", "p"), ("o", "u"), ("a", "l"), ("Ġ", "m"), ("i", "t"),
    ("Ġ", "i"), ("Ġ", "d"), ("l", "e"), ("Ġa", "n"), ("Ġ", "h"), ("Ġan", "d"), ("Ġ", "l"),
    ("Ġ", "n"), ("Ġ", "Ġ"), ("Ġo", "f"), ("Ġt", "o"), ("Ġ", "e"), ("i", "c"), ("Ġ", "g"),
    ("Ġi", "n"), ("o", "m"), ("Ġ", "re"), ("a", "s"), ("s", "t"), ("Ġ", "y"), ("l", "l"),
    ("Ġ", "u"), ("i", "on"), ("Ġ", "is"), ("Ġ", "it"), ("o", "w"), ("Ġw", "h"),
    ("Ġy", "ou"), ("e", "l"), ("Ċ", "Ċ"), ("c", "h"), ("'", "s"), ("Ġ", "T"),
)  # fmt: skip
_TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def tiny_tokenizer() -> Tokenizer:
    """The ``tiny-random`` model's tokenizer: 320 ids, byte-level, ChatML.

    Ids 0–2 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (both
    ends of text stop generation), 3–258 the 256 bytes, then a few merges.
    Every unicode string round-trips.
    """
    return Tokenizer(
        _tiny_backend(),
        bos_token=None,
        eos_token="<|im_end|>",
        add_bos=False,
        chat_template=_CHATML_TEMPLATE,
        extra_eos_token_ids=(0,),
    )


@cache
def _tiny_backend() -> tokenizers.Tokenizer:
    vocab: dict[str, int] = {}
    for special in _TINY_SPECIALS:
        vocab[special] = len(vocab)
    for symbol in _bytes_to_unicode().values():
        vocab[symbol] = len(vocab)
    for left, right in _TINY_MERGES:
        assert left in vocab and right in vocab, (left, right)
        vocab.setdefault(left + right, len(vocab))
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=list(_TINY_MERGES)))
    _set_byte_level_pipeline(tok, "gpt2")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in _TINY_SPECIALS])
    return tok


# ---------------------------------------------------------------------- helpers


@cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _set_byte_level_pipeline(tok: tokenizers.Tokenizer, pre: str) -> None:
    """Pre-tokenizer and decoder of a byte-level BPE, as HF's tokenizer.json has them."""
    if pre in _GPT2_PRE:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in _DIGITS_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        pattern = _LLAMA3_PATTERN if pre in _LLAMA3_PRE else _QWEN2_PATTERN
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        if pre in _QWEN2_PRE:
            tok.normalizer = normalizers.NFC()
    else:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported")
    tok.decoder = decoders.ByteLevel()


def _as_str(value: Any) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8")
    return str(value)


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or AddedToken dicts."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        content = value.get("content")
        return None if content is None else str(content)
    return str(value)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@cache
def _chat_template_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    # The same environment transformers renders chat templates in.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
