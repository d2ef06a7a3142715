"""Policy spec strings (``snapkv(ratio=0.5)+kivi(bits=4)``) parsed once, at the edge, into a :class:`PolicyStack`."""

from __future__ import annotations

import ast
import difflib
import re
import types
import typing
from dataclasses import MISSING, dataclass, fields

from kveval.errors import PolicySpecError
from kveval.policies.base import FAMILY_ORDER, Policy, PolicyStack
from kveval.policies.registry import POLICIES
from kveval.values import is_real

_TERM = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\((.*)\))?\s*$", re.S)

_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a word"}


@dataclass(frozen=True)
class ParamType:
    """The declared type of one policy parameter: ``bool``, ``int``, ``float`` or ``str``, optionally ``None``."""

    base: type
    optional: bool

    @classmethod
    def of(cls, annotation) -> "ParamType":
        args = typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            rest = [a for a in args if a is not type(None)]
            if len(rest) != 1 or rest[0] not in _TYPE_WORDS:
                raise TypeError(f"unsupported parameter type {annotation!r}")
            return cls(rest[0], True)
        if annotation not in _TYPE_WORDS:
            raise TypeError(f"unsupported parameter type {annotation!r}")
        return cls(annotation, False)

    def describe(self) -> str:
        return _TYPE_WORDS[self.base] + (" or none" if self.optional else "")

    def convert(self, value):
        """Convert spec text (or an already typed value) to this type; raise ``ValueError`` if it is not one."""
        if isinstance(value, str):
            text = value.strip()
            if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
                text = text[1:-1]
                if self.base is str:
                    return text
            if text.lower() in ("none", "null"):
                if self.optional:
                    return None
                raise ValueError
            if self.base is str:
                if not text:
                    raise ValueError
                return text
            if self.base is bool:
                if text.lower() not in ("true", "false"):
                    raise ValueError
                return text.lower() == "true"
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                raise ValueError from None
        if value is None and self.optional:
            return None
        if self.base is bool:
            if isinstance(value, bool):
                return value
            raise ValueError
        if isinstance(value, bool):  # True is an int to Python, not to a spec
            raise ValueError
        if self.base is int and isinstance(value, int):
            return value
        if self.base is float and is_real(value):
            return float(value)
        if self.base is str and isinstance(value, str):
            return value
        raise ValueError


def param_types(cls: type["Policy"]) -> dict[str, ParamType]:
    """Declared type of every spec parameter of a policy class, in field order."""
    hints = typing.get_type_hints(cls)
    return {f.name: ParamType.of(hints[f.name]) for f in fields(cls)}


def param_defaults(cls: type["Policy"]) -> dict[str, object]:
    """Default of every spec parameter (``None`` where it has none)."""
    return {f.name: (None if f.default is MISSING else f.default) for f in fields(cls)}


def _split_terms(spec: str) -> list[str]:
    """Split on ``+`` outside parentheses."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "+" and depth == 0:
            terms.append(spec[start:i])
            start = i + 1
    terms.append(spec[start:])
    return terms


def parse_term(term: str) -> Policy:
    """Parse one ``name(key=value, ...)`` term into a validated policy object.

    Every value is converted to its parameter's declared type (``bool``:
    ``true``/``false`` only; ``int``: integers only; ``float``: any number;
    ``none`` where the parameter is optional). Anything else, an unknown or
    repeated parameter, or a value out of range raises :class:`PolicySpecError`.
    """
    match = _TERM.match(term)
    if not match:
        raise PolicySpecError(f"cannot parse policy term {term.strip()!r}; write it as name(key=value, ...), e.g. window(size=256)")
    name, args = match.group(1).lower(), match.group(2)
    if name not in POLICIES:
        close = difflib.get_close_matches(name, list(POLICIES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise PolicySpecError(f"unknown policy {name!r}{hint}; known policies: {', '.join(sorted(POLICIES))} (see `kveval policies`)")
    cls = POLICIES[name]
    types_ = param_types(cls)
    valid = list(types_)
    raw: dict[str, str] = {}
    if args and args.strip():
        for i, part in enumerate(args.split(",")):
            if "=" in part:
                key, value = (x.strip() for x in part.split("=", 1))
            elif i == 0 and valid:  # one positional argument: the first field, e.g. window(64)
                key, value = valid[0], part.strip()
            else:
                raise PolicySpecError(f"{name}: argument {part.strip()!r} needs a name; parameters: {', '.join(valid) or 'none'}")
            if key not in types_:
                raise PolicySpecError(f"{name} has no parameter {key!r}; parameters: {', '.join(valid) or 'none'}")
            if key in raw:
                raise PolicySpecError(f"{name}: parameter {key!r} is given twice ({key}={raw[key]} and {key}={value}); give it once")
            raw[key] = value
    return make_policy(cls, raw)


def make_policy(cls: type["Policy"], params: dict) -> "Policy":
    """Build a policy from parameter values (spec text or typed values), checking each against its declared type."""
    types_ = param_types(cls)
    kwargs = {}
    for key, value in params.items():
        if key not in types_:
            raise PolicySpecError(f"{cls.name} has no parameter {key!r}; parameters: {', '.join(types_) or 'none'}")
        try:
            kwargs[key] = types_[key].convert(value)
        except ValueError:
            raise PolicySpecError(f"{cls.name}: {key}={value} is not {types_[key].describe()}") from None
    try:
        policy = cls(**kwargs)
    except PolicySpecError:
        raise
    except (TypeError, ValueError) as exc:
        raise PolicySpecError(f"{cls.name}: {exc}") from exc
    policy.given = frozenset(kwargs)
    policy.check_given()
    return policy


def parse_policy(spec: "str | PolicyStack | None") -> PolicyStack:
    """Parse a spec string such as ``"snapkv(ratio=0.5)+kivi(bits=4)"``.

    Raises
    ------
    PolicySpecError
        (a ``ValueError``) One line naming the problem: unknown policy or parameter, value out of
        range, or two policies of the same family.
    """
    if isinstance(spec, PolicyStack):
        return spec
    if spec is None or not str(spec).strip():
        return PolicyStack()
    stack = PolicyStack()
    for term in _split_terms(str(spec)):
        if not term.strip():
            raise PolicySpecError(f"empty term in policy spec {spec!r}; join policies with a single '+'")
        policy = parse_term(term)
        if policy.family == "none":
            continue
        try:
            stack = stack.with_policy(policy)
        except PolicySpecError:
            raise PolicySpecError(f"policy spec {spec!r} has two {policy.family} policies; stack at most one each of "
                                  f"{', '.join(FAMILY_ORDER)}") from None
    structure = stack.structure
    for other in (stack.selection, stack.quantization):
        if structure is not None and other is not None and other.family not in structure.stacks_with:
            raise PolicySpecError(f"policy spec {spec!r}: {structure.name} does not stack with a {other.family} "
                                  f"policy ({other.spec()}); evaluate {structure.spec()} alone")
        why = structure.stack_refusal(other) if structure is not None and other is not None else None
        if why is not None:
            raise PolicySpecError(f"policy spec {spec!r}: {structure.name} does not stack with {other.spec()}: {why}")
    if (stack.selection is not None and stack.selection.per_head_budgets and stack.structure is not None
            and not stack.structure.keeps_head_widths):
        raise PolicySpecError(f"policy spec {spec!r}: {stack.selection.name} keeps a different number of tokens per head, "
                              f"which {stack.structure.name} cannot store; stack it with quantization only")
    stack.fit_groups()
    return stack
