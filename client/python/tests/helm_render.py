"""A renderer for the subset of Helm's templates that deploy/helm/attnd uses, for machines without
`helm` (test_helm.py renders the chart with both where helm is installed and requires the same
objects). It is strict where Helm is lenient: a value path missing from the values, an unknown
function or construct, or an unbalanced block is an error, so a typo in the chart fails here even
where Helm would render it as empty.

Supported (what the chart uses; anything else is an error): text with {{ }} actions and their
{{- -}} trim markers, comments; if / else if / else, with, define / include; pipelines with | and
parentheses; the functions default, quote, toYaml, nindent, printf (%s %d %v), eq, ne, not, and,
or, fail, trunc, trimSuffix, int64, kindIs, splitList, index, replace, b64enc, lookup (as
`helm template` has it: nothing found) and randAlphaNum (here a fixed string, so renders compare;
Helm's is random); .Values,
.Release.Name/Namespace, .Chart.Name/Version/AppVersion, .Files.Get and
.Capabilities.APIVersions.Has. As Helm does, the values are checked against values.schema.json
first, and a number from the values prints as Go prints a float64 (Helm reads values.yaml's
numbers as float64s: 1000000 prints as 1e+06), except that a whole number Go would print in that
form is an error here: the chart must pipe it through int64. NOTES.txt renders with notes().

deploy/helm/gorender renders the same templates with Go's own text/template, and test_helm.py
compares the two."""

from __future__ import annotations

import base64
import decimal
import json
import re
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import jsonschema
import yaml


class TemplateError(Exception):
    """The chart uses something this renderer does not know, or refers to a missing value."""


class Fail(Exception):
    """The chart's own `fail`: a refused configuration (helm: 'execution error')."""


class SchemaError(Exception):
    """Values that values.schema.json refuses (helm: "values don't meet the specifications")."""


_ACTION = re.compile(r"{{(-\s)?(.*?)(\s-)?}}", re.S)
_TOKEN = re.compile(r'\s*(?:("(?:[^"\\]|\\.)*")|(\$?\.[A-Za-z0-9_.]*|\$)|(-?\d+(?:\.\d+)?)'
                    r"|([A-Za-z_][A-Za-z0-9_]*)|(\|)|(\()|(\)))")


def _lex(text: str) -> List[Tuple[str, Any]]:
    """One action's words: ('str', s), ('field', '.A.b'), ('num', n), ('ident', f), or one of
    '|', '(' and ')'."""
    out: List[Tuple[str, Any]] = []
    pos, text = 0, text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise TemplateError(f"cannot read {text[pos:]!r} in {{{{ {text} }}}}")
        pos = m.end()
        s, field, num, ident, bar, lp, rp = m.groups()
        if s is not None:
            out.append(("str", json.loads(s)))
        elif field is not None:
            out.append(("field", field))
        elif num is not None:
            out.append(("num", float(num) if "." in num else int(num)))
        elif ident is not None:
            out.append(("ident", ident))
        else:
            out.append(((bar or lp or rp), None))
    return out


def _parse(src: str) -> List[Any]:
    """The template as a tree: text strings and (kind, words, body, else) nodes."""
    pieces: List[Any] = []
    pos = 0
    for m in _ACTION.finditer(src):
        text = src[pos:m.start()]
        if m.group(1):
            text = text.rstrip()
        if pieces and isinstance(pieces[-1], tuple) and pieces[-1][0] == "trim":
            text = text.lstrip()
            pieces.pop()
        pieces.append(text)
        body = m.group(2).strip()
        if not body.startswith("/*"):
            pieces.append(("action", body))
        if m.group(3):
            pieces.append(("trim",))
        pos = m.end()
    tail = src[pos:]
    if pieces and isinstance(pieces[-1], tuple) and pieces[-1][0] == "trim":
        tail = tail.lstrip()
        pieces.pop()
    pieces.append(tail)

    root: List[Any] = []
    stack: List[Tuple[Optional[Dict[str, Any]], List[Any]]] = [(None, root)]
    for p in pieces:
        if isinstance(p, str):
            if p:
                stack[-1][1].append(p)
            continue
        if p[0] == "trim":  # a trim marker followed directly by another action
            continue
        body = p[1]
        word = body.split(None, 1)[0] if body else ""
        rest = body[len(word):].strip()
        if word in ("if", "with", "define"):
            node = {"kind": word, "words": _lex(rest), "body": [], "else": None}
            stack[-1][1].append(node)
            stack.append((node, node["body"]))
        elif word == "else":
            node, _ = stack[-1]
            if node is None or node["kind"] not in ("if", "with") or node["else"] is not None:
                raise TemplateError("else outside if/with")
            node["else"] = []
            if rest.startswith("if "):  # else if: a nested if that shares the outer end
                inner = {"kind": "if", "words": _lex(rest[3:]), "body": [], "else": None,
                         "chained": True}
                node["else"].append(inner)
                stack[-1] = (node, node["else"])
                stack.append((inner, inner["body"]))
            else:
                stack[-1] = (node, node["else"])
        elif word == "end":
            while True:
                if len(stack) == 1:
                    raise TemplateError("end without a block")
                node, _ = stack.pop()
                if not node.get("chained"):
                    break
        else:
            stack[-1][1].append({"kind": "print", "words": _lex(body)})
    if len(stack) != 1:
        raise TemplateError(f"{stack[-1][0]['kind']} block without end")
    return root


def _truthy(v: Any) -> bool:
    return v not in (None, False, 0, "", [], {}) if not isinstance(v, float) else v != 0


class _Int64(int):
    """A number made by int64: Go prints it as digits, whatever its size."""


def _go_float(x: float) -> str:
    """Go's %v of a float64: the shortest digits that read back, in e-notation when the exponent
    is below -4 or at least 6 (the `shortest` rule of strconv's %g)."""
    if x == 0:
        return "0"
    sign, digits, exp = decimal.Decimal(repr(x)).normalize().as_tuple()
    e = len(digits) + exp - 1  # the decimal exponent of the first digit
    if -4 <= e < 6:
        return format(decimal.Decimal(repr(x)).normalize(), "f")
    mantissa = str(digits[0]) + ("." + "".join(map(str, digits[1:])) if len(digits) > 1 else "")
    return f"{'-' if sign else ''}{mantissa}e{'-' if e < 0 else '+'}{abs(e):02d}"


def _text(v: Any) -> str:
    if v is None:
        raise TemplateError("printing a missing value")
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (dict, list)):
        raise TemplateError(f"printing a map or list ({v!r}): use toYaml")
    if isinstance(v, _Int64):
        return str(int(v))
    if isinstance(v, (int, float)):  # from the values: a float64 in Helm
        s = _go_float(float(v))
        if isinstance(v, int) and "e" in s:
            raise TemplateError(f"Helm prints the value {v} as {s}: pipe it through int64")
        return s
    return str(v)


def _int64(v: Any) -> _Int64:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TemplateError(f"int64 of {v!r}: only numbers here")
    return _Int64(int(v))


def _kind(v: Any) -> str:
    """Go's reflect kind name of a value as Helm holds it."""
    if v is None:
        return "invalid"
    for python, go in ((bool, "bool"), (_Int64, "int64"), ((int, float), "float64"),
                       (str, "string"), (dict, "map"), (list, "slice")):
        if isinstance(v, python):
            return go
    raise TemplateError(f"no Go kind for {v!r}")


def _index(collection: Any, i: Any) -> Any:
    if not isinstance(collection, list) or not isinstance(i, int) or not 0 <= i < len(collection):
        raise TemplateError(f"index {i!r} out of range of {collection!r}")
    return collection[i]


def _indent(n: int, s: str) -> str:
    return "\n".join(" " * n + line for line in s.split("\n"))


def _printf(fmt: str, *args: Any) -> str:
    it = iter(args)
    return re.sub(r"%[sdv]", lambda _: _text(next(it)), fmt)


def _to_yaml(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=False, sort_keys=True).rstrip("\n") \
        if v not in (None, {}, []) else ("{}" if v == {} else "[]" if v == [] else "null")


class Chart:
    def __init__(self, path: Path):
        self.path = path
        self.meta = yaml.safe_load((path / "Chart.yaml").read_text())
        self.defaults = yaml.safe_load((path / "values.yaml").read_text())
        schema = path / "values.schema.json"
        self.schema = json.loads(schema.read_text()) if schema.exists() else None
        if self.schema is not None:
            jsonschema.Draft7Validator.check_schema(self.schema)
        self.defines: Dict[str, List[Any]] = {}
        self.templates: Dict[str, List[Any]] = {}
        self.notes_tree: List[Any] = []
        for t in sorted((path / "templates").iterdir()):
            if t.suffix not in (".yaml", ".tpl", ".txt"):
                continue
            tree = _parse(t.read_text())
            for node in tree:
                if isinstance(node, dict) and node["kind"] == "define":
                    self.defines[node["words"][0][1]] = node["body"]
            if t.name == "NOTES.txt":  # shown by helm install, not an object
                self.notes_tree = tree
            elif t.suffix == ".yaml":
                self.templates[t.name] = tree

    def render(self, values: Optional[Dict[str, Any]] = None, release: str = "attnd",
               namespace: str = "default",
               api_versions: Iterable[str] = ()) -> List[Dict[str, Any]]:
        """The objects `helm template RELEASE CHART --set ... --api-versions ...` would make
        (`api_versions`: what .Capabilities.APIVersions.Has finds, e.g.
        "monitoring.coreos.com/v1/ServiceMonitor" on a cluster with the Prometheus Operator)."""
        top = self._top(values, release, namespace, api_versions)
        docs: List[Dict[str, Any]] = []
        for name, tree in self.templates.items():
            out = self._run(tree, top, top)
            try:
                docs += [d for d in yaml.safe_load_all(out) if d]
            except yaml.YAMLError as e:
                raise TemplateError(f"{name} renders invalid YAML: {e}\n{out}") from e
        return docs

    def notes(self, values: Optional[Dict[str, Any]] = None, release: str = "attnd",
              namespace: str = "default", api_versions: Iterable[str] = ()) -> str:
        """What `helm install` prints after installing: NOTES.txt rendered."""
        top = self._top(values, release, namespace, api_versions)
        return self._run(self.notes_tree, top, top)

    def merged(self, values: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """values.yaml with `values` over it, as the templates see them; refused as Helm refuses
        values that values.schema.json does not allow."""
        merged = _merge(self.defaults, values or {})
        if self.schema is not None:
            errors = sorted(jsonschema.Draft7Validator(self.schema).iter_errors(merged),
                            key=lambda e: list(e.absolute_path))
            if errors:
                raise SchemaError("; ".join(
                    f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
                    for e in errors))
        return merged

    def _top(self, values: Optional[Dict[str, Any]], release: str, namespace: str,
             api_versions: Iterable[str]) -> Dict[str, Any]:
        return {"Values": self.merged(values),
                "Release": {"Name": release, "Namespace": namespace, "Service": "Helm"},
                "Chart": {"Name": self.meta["name"], "Version": self.meta["version"],
                          "AppVersion": self.meta["appVersion"]},
                "Files": _Files(self.path),
                "Capabilities": {"APIVersions": _APIVersions(api_versions)}}

    def _run(self, tree: List[Any], dot: Any, top: Dict[str, Any]) -> str:
        out = []
        for node in tree:
            if isinstance(node, str):
                out.append(node)
                continue
            kind = node["kind"]
            if kind == "define":
                continue
            if kind == "print":
                out.append(_text(self._eval(node["words"], dot, top)))
            elif kind in ("if", "with"):
                v = self._eval(node["words"], dot, top)
                if _truthy(v):
                    out.append(self._run(node["body"], v if kind == "with" else dot, top))
                elif node["else"] is not None:
                    out.append(self._run(node["else"], dot, top))
        return "".join(out)

    def _eval(self, words: List[Tuple[str, Any]], dot: Any, top: Dict[str, Any]) -> Any:
        commands: List[List[Any]] = [[]]
        i = 0
        while i < len(words):
            kind, val = words[i]
            if kind == "|":
                commands.append([])
            elif kind == "(":
                depth, j = 1, i + 1
                while depth:
                    if j == len(words):
                        raise TemplateError("unbalanced (")
                    depth += {"(": 1, ")": -1}.get(words[j][0], 0)
                    j += 1
                commands[-1].append(("value", self._eval(words[i + 1:j - 1], dot, top)))
                i = j - 1
            elif kind == ")":
                raise TemplateError("unbalanced )")
            else:
                commands[-1].append((kind, val))
            i += 1
        piped: Any = _NOTHING
        for cmd in commands:
            if not cmd:
                raise TemplateError("empty command in a pipeline")
            args = [self._operand(w, dot, top) for w in cmd[1:]]
            if piped is not _NOTHING:
                args.append(piped)
            head_kind, head = cmd[0]
            if head_kind == "ident":
                piped = self._call(head, args, dot, top)
            elif not args:
                piped = self._operand(cmd[0], dot, top)
            elif head_kind == "field":  # a method with arguments: .Files.Get "path"
                holder, _, method = head.rpartition(".")
                obj = self._operand(("field", holder or "."), dot, top)
                if isinstance(obj, dict) or not method[:1].isupper() or \
                        not callable(getattr(obj, method, None)):
                    raise TemplateError(f"{head} is not a method")
                piped = getattr(obj, method)(*args)
            else:
                raise TemplateError(f"{head} is not a function")
        return piped

    def _operand(self, word: Tuple[str, Any], dot: Any, top: Dict[str, Any]) -> Any:
        kind, val = word
        if kind in ("str", "num", "value"):
            return val
        if kind == "field":
            base, path = (top, val[1:]) if val.startswith("$") else (dot, val)
            if path in (".", ""):
                return base
            for part in path.strip(".").split("."):
                if not isinstance(base, dict) or part not in base:
                    raise TemplateError(f"{val}: no such value ({part!r} missing)")
                base = base[part]
            return base
        if kind == "ident" and val in ("true", "false"):
            return val == "true"
        if kind == "ident":
            return self._call(val, [], dot, top)
        raise TemplateError(f"unexpected {kind}")

    def _call(self, name: str, args: List[Any], dot: Any, top: Dict[str, Any]) -> Any:
        simple = {
            "default": lambda d, v=None: v if _truthy(v) else d,
            "quote": lambda v: json.dumps(_text(v)),
            "toYaml": _to_yaml,
            "nindent": lambda n, s: "\n" + _indent(n, s),
            "printf": _printf,
            "eq": lambda a, b: a == b,
            "ne": lambda a, b: a != b,
            "lt": lambda a, b: a < b,
            "not": lambda v: not _truthy(v),
            "trunc": lambda n, s: s[:n],
            "trimSuffix": lambda suffix, s: s[:-len(suffix)] if s.endswith(suffix) else s,
            "int64": _int64,
            "kindIs": lambda kind, v: _kind(v) == kind,
            "splitList": lambda sep, s: s.split(sep),
            "index": _index,
            "replace": lambda old, new, s: s.replace(old, new),
            "b64enc": lambda s: base64.b64encode(_text(s).encode()).decode(),
            "lookup": lambda api, kind, namespace, name: {},
            "randAlphaNum": lambda n: "r" * n,
        }
        if name == "include":
            template, ctx = args
            if template not in self.defines:
                raise TemplateError(f"include of undefined template {template!r}")
            return self._run(self.defines[template], ctx, top)
        if name == "and":
            return next((a for a in args if not _truthy(a)), args[-1])
        if name == "or":
            return next((a for a in args if _truthy(a)), args[-1])
        if name == "fail":
            raise Fail(args[0])
        if name not in simple:
            raise TemplateError(f"unknown function {name!r}")
        return simple[name](*args)


class _Files:
    def __init__(self, path: Path):
        self.path = path

    def Get(self, name: str) -> str:  # noqa: N802 (the template's spelling)
        return (self.path / name).read_text()


class _APIVersions:
    def __init__(self, versions: Iterable[str]):
        self.versions = set(versions)

    def Has(self, version: str) -> bool:  # noqa: N802 (the template's spelling)
        return version in self.versions


_NOTHING = object()


# Values that are maps of the user's own keys (labels, selectors, resources): merged, not checked.
_FREE_FORM = {"labels", "annotations", "nodeSelector", "podAnnotations", "podSecurityContext",
              "resources"}


def _merge(base: Dict[str, Any], over: Dict[str, Any], free: bool = False) -> Dict[str, Any]:
    """Helm's merge of user values over values.yaml; a key values.yaml lacks is an error (a typo
    Helm would ignore) except inside the free-form maps."""
    out = dict(base)
    for k, v in over.items():
        if k not in base and not free:
            raise TemplateError(f"value {k!r} is not in values.yaml")
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            out[k] = _merge(base[k], v, free or k in _FREE_FORM)
        else:
            out[k] = v
    return out
