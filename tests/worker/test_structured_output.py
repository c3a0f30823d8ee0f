"""StructuredOutputManager: compiling in the background, cached by spec; masks that allow
exactly what the grammar allows; greedy decoding over random logits that always yields
valid output ending in EOS; forked and freed matchers."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch
import xgrammar as xgr
from tiny_models import VOCAB_SIZE, build_tokenizer

from serve.sampling_params import StructuredOutputsParams as Spec
from serve.structured_outputs import unenforceable_json_schema
from serve.worker import structured_output
from serve.worker.structured_output import StructuredOutputManager, json_schema_grammar

TINY_EOS = 0
TINY_VOCAB = VOCAB_SIZE + 8  # a model vocab wider than the tokenizer, as real ones often are

NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": {"type": "boolean"}},
            "required": ["x", "y"],
        },
    },
    "required": ["name", "age", "point"],
}


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)  # every torch.randn below is a fresh, reproducible draw


@pytest.fixture
def tiny():
    manager = StructuredOutputManager(build_tokenizer(), TINY_VOCAB, [TINY_EOS])
    yield manager
    manager.shutdown()


@pytest.fixture(scope="module")
def smol():
    """The default model's tokenizer (vocab 49152, EOS <|im_end|>) and a manager for it."""
    from serve.models.default_model import resolve_default_model
    from serve.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_default_model())
    manager = StructuredOutputManager(tokenizer, 49152, [tokenizer.eos_token_id])
    yield tokenizer, manager
    manager.shutdown()


def compiled(manager, spec):
    return manager.submit(spec).result(timeout=60)


def drive(manager, specs, vocab_size, eos_id, seed, max_steps=200):
    """Greedy argmax over fresh random logits, masked each step, for one batch of sequences
    (spec None: an unconstrained row that is sampled but never fed to a matcher).
    Returns each constrained sequence's tokens, ending in EOS."""
    generator = torch.Generator().manual_seed(seed)
    seq_ids = list(range(len(specs)))
    for seq_id, spec in zip(seq_ids, specs):
        if spec is not None:
            manager.start(seq_id, compiled(manager, spec))
    tokens = {seq_id: [] for seq_id, spec in zip(seq_ids, specs) if spec is not None}
    for _ in range(max_steps):
        running = [s for s in tokens if not manager.is_terminated(s)]
        if not running:
            break
        logits = torch.randn(len(seq_ids), vocab_size, generator=generator)
        manager.mask_logits(logits, seq_ids)
        for seq_id in running:
            token_id = int(logits[seq_id].argmax())
            assert manager.accept(seq_id, token_id)
            tokens[seq_id].append(token_id)
    for seq_id in tokens:
        assert manager.is_terminated(seq_id), f"no EOS within {max_steps} steps: {tokens[seq_id]}"
        assert tokens[seq_id][-1] == eos_id
        manager.free(seq_id)
    return [tokens[s] for s in tokens]


def allowed_by_matcher(manager, seq_id, vocab_size):
    """The next tokens `seq_id`'s matcher accepts, asked token by token of fresh forks."""
    matcher = manager._matchers[seq_id]
    return {t for t in range(vocab_size) if matcher.fork().accept_token(t)}


def finite(row):
    return set(torch.isfinite(row).nonzero().flatten().tolist())


# ---- compiling ----


def test_one_compile_per_spec_off_the_callers_thread(tiny):
    threads, calls = [], []
    compile_ = tiny._compile

    def recording_compile(key):
        threads.append(threading.get_ident())
        calls.append(key)
        return compile_(key)

    tiny._compile = recording_compile
    first = compiled(tiny, Spec(json=NESTED_SCHEMA))
    assert compiled(tiny, Spec(json=json.loads(json.dumps(NESTED_SCHEMA)))) is first
    assert compiled(tiny, Spec(json=json.dumps(NESTED_SCHEMA, indent=2))) is first  # any layout
    assert compiled(tiny, Spec(regex="a+")) is compiled(tiny, Spec(regex="a+"))
    assert len(calls) == 2
    # Property order is the user's: it decides the order of the output's keys.
    reordered = {**NESTED_SCHEMA, "properties": dict(reversed(NESTED_SCHEMA["properties"].items()))}
    assert compiled(tiny, Spec(json=reordered)) is not first
    assert len(calls) == 3
    assert threading.get_ident() not in threads


def test_concurrent_submits_of_one_spec_share_one_future(tiny):
    release, calls = threading.Event(), []
    compile_ = tiny._compile

    def held_compile(key):
        calls.append(key)
        return release.wait(10) and compile_(key)

    tiny._compile = held_compile
    futures = [None] * 4

    def submit(i):
        futures[i] = tiny.submit(Spec(choice=("yes", "no")))

    submitters = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
    for thread in submitters:
        thread.start()
    for thread in submitters:
        thread.join()
    assert all(future is futures[0] for future in futures)
    assert not futures[0].done()  # the callers did not wait for the compile
    release.set()
    grammar = futures[0].result(timeout=60)
    assert len(calls) == 1
    # The shared result is the grammar itself: a matcher started from it allows exactly
    # the tokens that begin one of the choices.
    tiny.start(0, grammar)
    logits = torch.randn(1, TINY_VOCAB)
    tiny.mask_logits(logits, [0])
    assert finite(logits[0]) == choice_prefix_tokens(build_tokenizer(), ("yes", "no"))


@pytest.mark.parametrize(
    "spec, message",
    [
        (Spec(json={"type": "objectx"}), 'Invalid JSON schema: Unsupported type "objectx"'),
        (Spec(json="{not json"), "Invalid JSON schema: Expecting property name"),
        (Spec(json={"type": "integer", "minimum": 5, "maximum": 1}), "Invalid JSON schema: "),
        (Spec(regex="a(b"), "Invalid regex: Regex parsing error at position 4"),
        (
            Spec(grammar="root ::= foo"),
            'Invalid grammar: EBNF parser error at line 1, column 10: Rule "foo" is not defined',
        ),
        (Spec(grammar='rule ::= "a"'), 'The root rule with name "root" is not found'),
        (Spec(grammar='root ::= "a'), "Invalid grammar: EBNF lexer error"),
    ],
)
def test_invalid_spec_raises_a_clear_value_error(tiny, spec, message):
    with pytest.raises(ValueError) as info:
        tiny.submit(spec).result(timeout=60)
    assert message in str(info.value)
    assert not re.search(r"\.cc:\d+|\[\d\d:\d\d", str(info.value))  # no C++ file, no clock


def test_a_failed_compile_is_not_cached(tiny):
    bad = Spec(regex="a(b")
    first = tiny.submit(bad)
    with pytest.raises(ValueError):
        first.result(timeout=60)
    second = tiny.submit(bad)
    assert second is not first
    with pytest.raises(ValueError, match="Invalid regex"):
        second.result(timeout=60)


def test_a_grammar_too_large_is_refused_and_the_cache_is_bounded_by_bytes(tiny, monkeypatch):
    """A schema of many enum properties compiles to a grammar of hundreds of MB over a
    real vocabulary: refused past MAX_GRAMMAR_BYTES, and the cache holds so many bytes."""
    size = len(compiled(tiny, Spec(json=NESTED_SCHEMA)))
    monkeypatch.setattr(structured_output, "MAX_GRAMMAR_BYTES", size - 1)
    with pytest.raises(ValueError, match=r"compiles to a grammar of .* Simplify it"):
        compiled(tiny, Spec(json={**NESTED_SCHEMA, "title": "another"}))
    monkeypatch.setattr(structured_output, "MAX_GRAMMAR_BYTES", 1 << 30)
    monkeypatch.setattr(structured_output, "MAX_CACHED_GRAMMAR_BYTES", 3 * size)
    for i in range(6):
        compiled(tiny, Spec(json={**NESTED_SCHEMA, "title": f"schema {i}"}))
    assert 1 < len(tiny._compiled) <= 3  # the newest, within the bytes


def test_a_grammar_is_loaded_once_for_the_requests_that_share_it(tiny, monkeypatch):
    loads = []
    deserialize = xgr.CompiledGrammar.deserialize_json

    def counting(grammar, tokenizer_info):
        loads.append(len(grammar))
        return deserialize(grammar, tokenizer_info)

    monkeypatch.setattr(xgr.CompiledGrammar, "deserialize_json", staticmethod(counting))
    grammar = compiled(tiny, Spec(json=NESTED_SCHEMA))
    for seq_id in range(3):
        tiny.start(seq_id, "".join(grammar))  # a copy of the text, as it arrives in a step
    assert len(loads) == 1
    tiny.start(3, compiled(tiny, Spec(regex="a+")))
    assert len(loads) == 2


# ---- masks ----


def test_mask_logits_mixed_batch(tiny):
    """Rows 0 and 2 constrained, 1 and 3 not: constrained rows are -inf exactly where the
    matcher rejects the token (checked for every id), the others unchanged bit for bit."""
    tiny.start(10, compiled(tiny, Spec(choice=("yes", "no"))))
    tiny.start(12, compiled(tiny, Spec(regex=r"[0-9]{2}-[a-c]+")))
    assert tiny.accept(12, build_tokenizer().convert_tokens_to_ids("4"))
    logits = torch.randn(4, TINY_VOCAB)
    original = logits.clone()
    tiny.mask_logits(logits, [10, 11, 12, 13])
    assert torch.equal(logits[1], original[1]) and torch.equal(logits[3], original[3])
    for row, seq_id in ((0, 10), (2, 12)):
        allowed = allowed_by_matcher(tiny, seq_id, TINY_VOCAB)
        assert allowed and finite(logits[row]) == allowed
        assert torch.equal(logits[row][sorted(allowed)], original[row][sorted(allowed)])
        assert torch.isneginf(logits[row]).sum() == TINY_VOCAB - len(allowed)
    assert TINY_EOS not in finite(logits[0])  # nothing chosen yet: EOS is not allowed


def choice_prefix_tokens(tokenizer, choices):
    """Token ids whose text is a non-empty prefix of one of the choices."""
    vocab = len(tokenizer)
    texts = [tokenizer.decode([t]) for t in range(vocab)]
    return {t for t, s in enumerate(texts) if s and any(c.startswith(s) for c in choices)}


def test_choice_mask_allows_only_prefixes_tiny(tiny):
    tiny.start(0, compiled(tiny, Spec(choice=("yes", "no"))))
    logits = torch.randn(1, TINY_VOCAB, generator=torch.Generator().manual_seed(1))
    tiny.mask_logits(logits, [0])
    assert finite(logits[0]) == choice_prefix_tokens(build_tokenizer(), ("yes", "no"))


@pytest.mark.slow
def test_choice_mask_allows_only_prefixes_default_model(smol):
    tokenizer, manager = smol
    manager.start(0, compiled(manager, Spec(choice=("yes", "no"))))
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(2))
    original = logits.clone()
    manager.mask_logits(logits, [0, 1])
    expected = choice_prefix_tokens(tokenizer, ("yes", "no"))
    assert {tokenizer.decode([t]) for t in expected} >= {"yes", "no", "y", "n"}
    assert finite(logits[0]) == expected
    assert torch.equal(logits[1], original[1])
    manager.free(0)


def test_after_completion_only_eos_is_allowed(tiny):
    tokenizer = build_tokenizer()
    tiny.start(0, compiled(tiny, Spec(choice=("yes", "no"))))
    for token_id in tokenizer.encode("yes"):
        assert tiny.accept(0, token_id)
    logits = torch.randn(1, TINY_VOCAB, generator=torch.Generator().manual_seed(3))
    tiny.mask_logits(logits, [0])
    assert finite(logits[0]) == {TINY_EOS}
    assert not tiny.is_terminated(0)
    assert tiny.accept(0, TINY_EOS) and tiny.is_terminated(0)
    logits = torch.randn(1, TINY_VOCAB)
    original = logits.clone()
    tiny.mask_logits(logits, [0])  # a terminated sequence is left alone
    assert torch.equal(logits, original)


def test_accept_rejects_a_disallowed_token(tiny):
    tokenizer = build_tokenizer()
    tiny.start(0, compiled(tiny, Spec(regex="[0-9]+")))
    assert not tiny.accept(0, tokenizer.convert_tokens_to_ids("a"))
    assert not tiny.accept(0, TINY_EOS)  # nothing matched yet
    assert tiny.accept(0, tokenizer.convert_tokens_to_ids("7"))


def test_mask_logits_checks_the_shape(tiny):
    tiny.start(0, compiled(tiny, Spec(regex="a")))
    with pytest.raises(ValueError, match="one row per seq_id"):
        tiny.mask_logits(torch.zeros(2, TINY_VOCAB), [0])
    with pytest.raises(ValueError, match="one row per seq_id"):
        tiny.mask_logits(torch.zeros(1, VOCAB_SIZE), [0])


def test_bitmask_buffer_grows_with_the_batch(tiny):
    compiled_regex = compiled(tiny, Spec(regex="[a-c]"))
    for num_rows in (1, 20, 3):
        for seq_id in range(num_rows):
            tiny.start(seq_id, compiled_regex)
        logits = torch.randn(num_rows, TINY_VOCAB)
        tiny.mask_logits(logits, list(range(num_rows)))
        allowed = allowed_by_matcher(tiny, 0, TINY_VOCAB)
        assert all(finite(row) == allowed for row in logits)
    assert tiny._bitmask.shape[0] == 20


# ---- fork and free ----


def test_fork_is_an_independent_copy(tiny):
    tokenizer = build_tokenizer()
    a, b, c = (tokenizer.convert_tokens_to_ids(ch) for ch in "abc")
    tiny.start(0, compiled(tiny, Spec(regex="a(b|c)d")))
    assert tiny.accept(0, a)
    tiny.fork(0, 1)
    assert tiny.accept(0, b)
    assert tiny.accept(1, c)  # the parent's b did not reach the child
    assert not tiny.accept(0, c)
    tiny.fork(1, 2)
    tiny.free(1)
    assert not tiny.has(1) and tiny.has(2)
    d = tokenizer.convert_tokens_to_ids("d")
    assert tiny.accept(2, d) and tiny.accept(2, TINY_EOS) and tiny.is_terminated(2)
    assert not tiny.is_terminated(0)


def test_free_drops_the_state(tiny):
    tiny.start(5, compiled(tiny, Spec(regex="x")))
    tiny.free(5)
    tiny.free(5)  # idempotent
    assert not tiny.has(5)
    logits = torch.randn(1, TINY_VOCAB)
    original = logits.clone()
    tiny.mask_logits(logits, [5])
    assert torch.equal(logits, original)
    with pytest.raises(KeyError):
        tiny.accept(5, 0)


# ---- greedy decoding over random logits always yields valid output ----

CHOICES = ("yes", "no", 'say "hi"', "back\\slash", "new\nline", "café", "😀", "")


def test_choice_literals_are_escaped(tiny):
    tokenizer = build_tokenizer()
    grammar = compiled(tiny, Spec(choice=CHOICES))
    for seq_id, choice in enumerate(CHOICES):
        tiny.start(seq_id, grammar)
        for token_id in tokenizer.encode(choice):
            assert tiny.accept(seq_id, token_id), choice
        assert tiny.accept(seq_id, TINY_EOS) and tiny.is_terminated(seq_id), choice


@pytest.mark.parametrize("seed", range(6))
def test_random_greedy_tiny(tiny, seed):
    tokenizer = build_tokenizer()
    specs = [
        Spec(choice=CHOICES),
        None,
        Spec(regex=r"[0-9]{3}-[a-z]{1,4}"),
        Spec(json=NESTED_SCHEMA),
    ]
    choice, regex, obj = drive(tiny, specs, TINY_VOCAB, TINY_EOS, seed)
    assert tokenizer.decode(choice[:-1]) in CHOICES
    assert re.fullmatch(r"[0-9]{3}-[a-z]{1,4}", tokenizer.decode(regex[:-1]))
    instance = json.loads(tokenizer.decode(obj[:-1]))
    jsonschema.validate(instance, NESTED_SCHEMA)
    assert list(instance) == [key for key in NESTED_SCHEMA["properties"] if key in instance]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_random_greedy_default_model(smol, seed):
    tokenizer, manager = smol
    eos = tokenizer.eos_token_id
    regex = r"(\+1 )?[0-9]{3}-[0-9]{4}"
    specs = [Spec(json=NESTED_SCHEMA), Spec(regex=regex), None, Spec(choice=CHOICES)]
    obj, phone, choice = drive(manager, specs, 49152, eos, seed)
    text = tokenizer.decode(obj[:-1])
    jsonschema.validate(json.loads(text), NESTED_SCHEMA)
    assert "\n" not in text and ",  " not in text  # any_whitespace=False: json.dumps layout
    assert re.fullmatch(regex, tokenizer.decode(phone[:-1]))
    assert tokenizer.decode(choice[:-1]) in CHOICES


@pytest.mark.parametrize("bounds", [{"maxLength": 6}, {"minLength": 1}, {}])
def test_json_strings_hold_no_control_characters_nor_special_tokens(tiny, bounds):
    """xgrammar 0.2.8 lets length-bounded strings hold raw control characters, and any
    string hold special tokens as text (which the detokenizer drops); ours hold neither."""
    tokenizer = build_tokenizer()
    tiny.start(0, compiled(tiny, Spec(json={"type": "string", **bounds})))
    assert tiny.accept(0, tokenizer.convert_tokens_to_ids('"'))
    logits = torch.randn(1, TINY_VOCAB)
    tiny.mask_logits(logits, [0])
    allowed = finite(logits[0])
    texts = [tokenizer.decode([t]) for t in allowed]
    assert "a" in texts and " the" in texts
    assert not [text for text in texts if any(ord(char) < 0x20 for char in text)]
    assert not allowed & set(tokenizer.all_special_ids)


def test_json_object_allows_any_object_only(tiny):
    grammar = compiled(tiny, Spec(json_object=True))
    for seq_id, text in enumerate(('{"a": [1, {"b": null}], "c": "d"}', "{}")):
        tiny.start(seq_id, grammar)
        assert tiny._matchers[seq_id].accept_string(text), text
        assert tiny.accept(seq_id, TINY_EOS) and tiny.is_terminated(seq_id), text
    tiny.start(0, grammar)
    assert not tiny._matchers[0].accept_string("[1]")
    logits = torch.randn(1, TINY_VOCAB)
    tiny.mask_logits(logits, [0])
    assert {build_tokenizer().decode([t])[0] for t in finite(logits[0])} == {"{"}


# ---- GPU ----


@pytest.mark.gpu
def test_mask_on_cuda_equals_mask_on_cpu(tiny):
    tiny.start(0, compiled(tiny, Spec(json=NESTED_SCHEMA)))
    tiny.start(2, compiled(tiny, Spec(choice=("yes", "no"))))
    logits = torch.randn(3, TINY_VOCAB, generator=torch.Generator().manual_seed(4))
    on_gpu = logits.cuda()
    tiny.mask_logits(logits, [0, 1, 2])
    tiny.mask_logits(on_gpu, [0, 1, 2])
    assert torch.equal(on_gpu.cpu(), logits)


# ---- what xgrammar ignores is refused; what it enforces is not ----

# (schema, an instance that breaks it, words of the refusal: the keyword and where it is).
# xgrammar 0.2.8's grammar for each schema accepts the instance: the output could be it.
IGNORED = [
    ({"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]}, "maybe", ["`allOf`", "root"]),
    (
        {
            "type": "object",
            "properties": {"tags": {"type": "array", "items": {}, "uniqueItems": True}},
        },
        {"tags": ["a", "a"]},
        ["`uniqueItems`", "at /properties/tags "],
    ),
    (
        {"type": "array", "items": {"type": "array", "items": {}, "contains": {"const": 5}}},
        [[1]],
        ["`contains`", "at /items "],
    ),
    (
        {
            "$defs": {"code": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}},
            "type": "object",
            "properties": {"c": {"$ref": "#/$defs/code"}},
            "required": ["c"],
        },
        {"c": "abcdef"},
        ["`maxLength` beside `pattern`", "at /$defs/code "],
    ),
    (
        {"anyOf": [{"type": "string", "format": "email", "maxLength": 8}, {"type": "null"}]},
        "averylongname@example.com",
        ["`maxLength` beside `format`", "at /anyOf/0 "],
    ),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
        {"a": 1},
        ["`required` 'b'", "root"],
    ),
    ({"type": "object", "required": ["x"]}, {}, ["`required` 'x'"]),
    (
        {"type": "array", "prefixItems": [{"type": "number", "multipleOf": 0.5}]},
        [0.3],
        ["`multipleOf`", "at /prefixItems/0 "],
    ),
    ({"type": "integer", "multipleOf": 2.5}, 3, ["`multipleOf`"]),
    ({"type": "integer", "not": {"const": 3}}, 3, ["`not`"]),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
            "if": {"properties": {"a": {"const": 1}}, "required": ["a"]},
            "then": {"required": ["b"]},
        },
        {"a": 1},
        ["`if`"],
    ),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        {"a": 1},
        ["`dependentRequired`"],
    ),
    (
        {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "bb": {"type": "integer"}},
                "propertyNames": {"maxLength": 1},
            },
        },
        {"k": {"a": 1, "bb": 2}},
        ["`propertyNames` beside `properties`", "at /additionalProperties "],
    ),
    (
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$", "maxLength": 2}},
        {"abc": 1},
        ["`maxLength` beside `pattern`", "at /propertyNames "],
    ),
    (
        {"type": "object", "properties": {"n": {"minimum": 3}}, "required": ["n"]},
        {"n": 1},
        ["`minimum` in a schema without `type`", "at /properties/n ", '"type": "number"'],
    ),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "anyOf": [{"type": "object"}],
        },
        {},
        ["`properties` beside `anyOf`"],
    ),
    (
        {"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": 1}]},
        "s",
        ["`type` beside `anyOf`"],
    ),
    (
        {"$defs": {"p": {"type": "integer"}}, "$ref": "#/$defs/p", "minimum": 3},
        1,
        ["beside `$ref`"],
    ),
    ({"type": "string", "format": "date", "pattern": "^2"}, "1914-11-24", ["`pattern` beside"]),
    (
        {
            "type": "object",
            "properties": {"a/b~c": {"type": "array", "items": {}, "uniqueItems": True}},
        },
        {"a/b~c": [1, 1]},
        ["at /properties/a~1b~0c "],  # RFC 6901 escapes
    ),
]
# (schema, an instance that breaks it): xgrammar enforces these, so they are let through.
ENFORCED = [
    ({"type": "integer", "multipleOf": 3}, 4),
    ({"type": "string", "pattern": "^[a-z]+$"}, "AB"),
    ({"type": "string", "minLength": 3}, "ab"),
    ({"type": ["string", "null"], "maxLength": 2}, "abc"),
    ({"allOf": [{"type": "integer", "minimum": 2}]}, 1),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}, {}),
    ({"properties": {"a": {"type": "integer"}}, "required": ["a"]}, {}),  # an object: inferred
    ({"type": "object", "propertyNames": {"pattern": "^[ab]$"}}, {"c": 1}),
    ({"type": "integer", "anyOf": [{"type": "integer", "minimum": 5}, {"enum": [0, 1]}]}, 3),
    ({"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "X"}, 1),
    (
        {
            "$defs": {"p": {"type": "integer", "minimum": 1}},
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/p", "description": "annotations only"}},
            "required": ["x"],
        },
        {"x": 0},
    ),
    (NESTED_SCHEMA, {"name": "a", "age": 130, "point": {"x": 1, "y": True}}),
    # "a or b": the object branches without a type of their own are objects all the same.
    (
        {
            "type": "object",
            "anyOf": [
                {"properties": {"a": {"type": "string"}}, "required": ["a"]},
                {"properties": {"b": {"type": "string"}}, "required": ["b"]},
            ],
        },
        {"c": "x"},
    ),
]


def grammar_accepts(schema, instance) -> bool:
    """Whether serve's grammar for `schema` (as json_schema_grammar builds it) matches
    `instance` as json.dumps writes it."""
    from xgrammar.testing import _is_grammar_accept_string

    grammar = json_schema_grammar(json.dumps(schema))
    if isinstance(grammar, str):
        grammar = xgr.Grammar.from_ebnf(grammar)
    return _is_grammar_accept_string(grammar, json.dumps(instance))


@pytest.mark.parametrize(("schema", "instance", "words"), IGNORED)
def test_what_xgrammar_ignores_is_refused(schema, instance, words):
    assert not jsonschema.Draft202012Validator(schema).is_valid(instance)
    # xgrammar's gap is real: its grammar takes the instance. (If an upgrade closes it,
    # this fails: drop the refusal.)
    assert grammar_accepts(schema, instance)
    problem = unenforceable_json_schema(schema)
    assert problem is not None and "not supported: xgrammar" in problem
    for word in words:
        assert word in problem, problem
    with pytest.raises(ValueError) as info:
        Spec(json=schema)
    assert str(info.value) == problem


@pytest.mark.parametrize(("schema", "instance"), ENFORCED)
def test_what_xgrammar_enforces_is_let_through(tiny, schema, instance):
    assert not jsonschema.Draft202012Validator(schema).is_valid(instance)
    assert not grammar_accepts(schema, instance)
    assert unenforceable_json_schema(schema) is None
    assert compiled(tiny, Spec(json=schema))


# ---- a grammar that starts after a token sequence (a reasoning model's end of thinking) ----

FREE = 9  # a token the grammar (choice "Paris") never allows first


class Waiting:
    """A step sampler and its grammars; each sequence it starts waits to be held to the
    choice "Paris" until its output completes `start_after`. `step` samples one favoured
    token a sequence (greedy), or checks proposals, and appends what was sampled."""

    def __init__(self, start_after: tuple[int, ...]) -> None:
        from serve.sampling_params import SamplingParams
        from serve.worker.lazy_structured_output import LazyStructuredOutput
        from serve.worker.step_sampler import StepSampler

        self.tokenizer = build_tokenizer()
        spec = Spec(choice=("Paris",), start_after_token_ids=start_after)
        self.params = SamplingParams(temperature=0.0, max_tokens=50, structured_outputs=spec)
        self.grammars = LazyStructuredOutput(lambda: self.tokenizer, TINY_VOCAB, [TINY_EOS])
        self.sampler = StepSampler(0, [TINY_EOS], self.grammars)
        self.grammar = compiled(self.grammars.get(), Spec(choice=("Paris",)))

    def seq(self, seq_id: int, prompt: list[int]):
        from serve.worker.sequence_mirror import MirroredSequence

        seq = MirroredSequence(seq_id, "r", prompt, self.params, None)
        self.sampler.start(seq, self.grammar, {})
        return seq

    def step(self, seqs, favoured: list[int], drafts: list[list[int]] | None = None):
        """One row a sequence favouring `favoured[i]` (with drafts: 1 + len(drafts[0])
        rows for seqs[0], favouring favoured[j] at row j)."""
        from serve.step import ModelRunnerOutput

        logits = torch.zeros(len(favoured), TINY_VOCAB)
        for row, token in enumerate(favoured):
            logits[row, token] = 10.0
        rows = [[seqs[0]]] if drafts else [[s] for s in seqs]
        output = ModelRunnerOutput()
        self.sampler.sample(logits, rows, None, [], output, drafts)
        assert not output.failed_requests
        by_id = {s.seq_id: s for s in seqs}
        for seq_id, token in zip(output.seq_ids, output.token_ids):
            by_id[seq_id].output_token_ids.append(token)
        return output

    def holds(self, seq) -> bool:
        """The sequence is held to the grammar: FREE, favoured, is masked."""
        (token,) = self.step([seq], [FREE]).token_ids
        if token == FREE:
            return False
        assert "Paris".startswith(self.tokenizer.decode([token]))
        return True


def test_a_grammar_waits_unconsulted_for_the_token_it_starts_after():
    """StructuredOutputsParams.start_after_token_ids (the API sets it from
    --reasoning-parser), one token: before the token is sampled the output is free (no
    mask, the grammar neither takes tokens nor ends the sequence); from the next token on
    it is held to the grammar. A fork waits alike."""
    from serve.worker.sequence_mirror import MirroredSequence

    end = 7
    waiting = Waiting((end,))
    seq = waiting.seq(1, [3, 4])
    for favoured in (FREE, TINY_EOS, FREE):  # free text, EOS not a grammar's end either
        output = waiting.step([seq], [favoured])
        assert output.token_ids == [favoured] and not output.grammar_ended_seq_ids
    child = MirroredSequence(2, "r", [3, 4], waiting.params, None, list(seq.output_token_ids))
    waiting.sampler.fork(seq, child)
    assert waiting.step([seq, child], [end, end]).token_ids == [end, end]  # starts after it
    assert waiting.holds(seq) and waiting.holds(child)
    grammars = waiting.grammars.get()
    assert grammars.has(seq.seq_id) and grammars.has(child.seq_id)
    waiting.sampler.forget([1, 2])
    assert not grammars.has(1)


# GPT-OSS's answer header in made-up ids: <|channel|> f in al <|message|>.
C, F, IN, AL, M = 7, 8, 10, 11, 12
HEADER = (C, F, IN, AL, M)


def test_a_grammar_waits_for_its_whole_start_sequence():
    """Several tokens: the output is free until it completes them in order; a partial match
    that breaks starts nothing (nor does the header of another channel); a match begun in
    the prompt counts; a fork mid-match goes on from where its parent was."""
    from serve.worker.sequence_mirror import MirroredSequence

    waiting = Waiting(HEADER)
    seq = waiting.seq(1, [3, 4])
    for token in (C, 20, 21, M, C, F, IN, FREE, C, F, IN, AL, FREE, M):  # analysis, broken
        assert waiting.step([seq], [token]).token_ids == [token]
    assert not waiting.grammars.get().has(seq.seq_id)
    for token in (C, C, F, IN):
        waiting.step([seq], [token])
    child = MirroredSequence(2, "r", [3, 4], waiting.params, None, list(seq.output_token_ids))
    waiting.sampler.fork(seq, child)
    assert waiting.step([seq, child], [AL, FREE]).token_ids == [AL, FREE]  # the child breaks
    assert waiting.step([seq, child], [M, M]).token_ids == [M, M]
    assert waiting.holds(seq) and not waiting.holds(child)
    # At the very start of the output, and begun in the prompt.
    first = waiting.seq(3, [3, 4])
    for token in HEADER:
        waiting.step([first], [token])
    begun = waiting.seq(4, [3, C, F])
    for token in (IN, AL, M):
        waiting.step([begun], [token])
    assert waiting.holds(first) and waiting.holds(begun)


def test_a_start_sequence_that_straddles_proposals():
    """Speculation (greedy): proposals are cut before the one that would complete the
    sequence, read on from the tokens before them (a match begun in earlier steps, or in
    the prompt, ends the kept proposals too); the completing token is then the one sampled
    after them, and the grammar holds the next step, as for one token."""
    from serve.sampling_params import SamplingParams
    from serve.worker.sequence_mirror import MirroredSequence
    from serve.worker.speculative import before_grammar_start

    waiting = Waiting(HEADER)
    seq = waiting.seq(1, [3, 4])
    for token in (FREE, C, F):  # the match begins: C F
        waiting.step([seq], [token])
    mirror = {1: seq}
    assert before_grammar_start({1: [IN, AL, M, FREE]}, mirror) == {1: [IN, AL]}
    assert before_grammar_start({1: [IN, FREE, C, F, IN, AL, M]}, mirror) == {
        1: [IN, FREE, C, F, IN, AL]
    }
    assert before_grammar_start({1: [IN, AL, FREE, M]}, mirror) == {1: [IN, AL, FREE, M]}
    prompted = MirroredSequence(2, "r", [3, C, F, IN, AL], waiting.params, None)
    assert before_grammar_start({2: [M, FREE]}, {2: prompted}) == {}  # M itself completes it
    any_object = SamplingParams(structured_outputs=Spec(json_object=True))
    unstarted = MirroredSequence(3, "r", [3], any_object, None, [C, F, IN, AL])
    assert before_grammar_start({3: [M, FREE]}, {3: unstarted}) == {3: [M, FREE]}
    # Checked: the kept proposals are accepted, then M, sampled after them, completes it.
    (drafts,) = before_grammar_start({1: [IN, AL, M, FREE]}, mirror).values()
    output = waiting.step([seq], [IN, AL, M], [drafts])
    assert output.token_ids == [IN, AL, M] and output.spec_accepted == {1: 2}
    assert not output.grammar_ended_seq_ids
    assert waiting.holds(seq)
