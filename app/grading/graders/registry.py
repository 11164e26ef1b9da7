"""Building graders from configs at start-up, the resources they share, and reading a graders file.

`build_graders` validates everything before the first grade: the type and fields of each config, every
template, the multi formula, the python source, that a metric can run offline, that a judge endpoint is
configured for model graders and that a state check exists. Every problem is a GraderConfigError naming
the file, the grader and the field. Every pack state check is also served as a grader under its own
name, with no config needed.
"""

from __future__ import annotations

import hashlib
import inspect
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import yaml

from app.grading.graders.formula import FormulaSyntaxError, compile_formula
from app.grading.graders.judge import Judge, JudgeSettings
from app.grading.graders.model import Grader, GraderConfigError, RolloutRecord
from app.grading.graders.model_graders import (
    LabelModelGrader,
    ScoreModelGrader,
    chat_params,
    compile_messages,
)
from app.grading.graders.multi import MultiGrader
from app.grading.graders.python_grader import PythonGrader, PythonSourceError
from app.grading.graders.python_pool import PythonPool, PythonPoolSettings
from app.grading.graders.similarity import MetricUnavailable, TextSimilarityGrader, local_metric
from app.grading.graders.specs import (
    ForbiddenToolsSpec,
    GraderSpec,
    GroundedSpec,
    LabelModelSpec,
    MultiSpec,
    NoLoopsSpec,
    PythonSpec,
    RequiredToolsSpec,
    ScoreModelSpec,
    SpecError,
    StateCheckSpec,
    StringCheckSpec,
    TextSimilaritySpec,
    ToolBudgetSpec,
    parse_spec,
    spec_version,
)
from app.grading.graders.string_check import StringCheckGrader
from app.grading.graders.templates import Template, TemplateError, compile_template
from app.grading.graders.trace import (
    ForbiddenToolsGrader,
    GroundedGrader,
    NoLoopsGrader,
    PackStateFactory,
    RequiredToolsGrader,
    StateCheckGrader,
    ToolBudgetGrader,
    pack_state,
)
from app.sdk import Pack, RolloutState, StateCheck

if TYPE_CHECKING:
    from app.config import Settings

GRADER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class GraderContext:
    """What graders need from the server, and the resources they share (closed by `aclose`).

    The judge client and the python pool are built on first use, so a server with neither kind of
    grader never starts them.
    """

    def __init__(
        self,
        *,
        judge: JudgeSettings | None = None,
        python: PythonPoolSettings | None = None,
        state_checks: Mapping[str, tuple[Pack, StateCheck]] | None = None,
        make_pack_state: PackStateFactory | None = None,
    ) -> None:
        self.judge_settings = judge or JudgeSettings()
        self.python_settings = python or PythonPoolSettings()
        self.state_checks: Mapping[str, tuple[Pack, StateCheck]] = dict(state_checks or {})
        self._make_pack_state = make_pack_state
        self._judge: Judge | None = None
        self._python_pool: PythonPool | None = None

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        state_checks: Mapping[str, tuple[Pack, StateCheck]] | None = None,
        make_pack_state: PackStateFactory | None = None,
    ) -> GraderContext:
        key = settings.judge_api_key.get_secret_value() if settings.judge_api_key is not None else None
        return cls(
            judge=JudgeSettings(
                base_url=settings.judge_base_url,
                api_key=key,
                timeout=settings.judge_timeout_seconds,
                max_retries=settings.judge_max_retries,
            ),
            python=PythonPoolSettings(
                workers=settings.python_grader_workers,
                timeout=settings.python_grader_timeout_seconds,
                memory_mb=settings.python_grader_memory_mb,
            ),
            state_checks=state_checks,
            make_pack_state=make_pack_state,
        )

    @property
    def judge(self) -> Judge:
        if self._judge is None:
            self._judge = Judge(self.judge_settings)
        return self._judge

    @property
    def python_pool(self) -> PythonPool:
        if self._python_pool is None:
            self._python_pool = PythonPool(self.python_settings)
        return self._python_pool

    def pack_state(self, pack_name: str, rollout: RolloutRecord | None) -> RolloutState:
        if self._make_pack_state is not None:
            return self._make_pack_state(pack_name, rollout)
        for pack, _ in self.state_checks.values():
            if pack.name == pack_name:
                return pack_state(pack, rollout)
        raise KeyError(f"no registered pack named {pack_name!r}")

    async def aclose(self) -> None:
        if self._python_pool is not None:
            await self._python_pool.aclose()
            self._python_pool = None
        if self._judge is not None:
            await self._judge.aclose()
            self._judge = None


def build_graders(
    configs: Mapping[str, Mapping[str, Any]], *, source: str, context: GraderContext
) -> dict[str, Grader]:
    """Every configured grader plus one per registered state check, validated; GraderConfigError otherwise."""
    graders: dict[str, Grader] = {}
    for name, raw in configs.items():
        if not isinstance(name, str) or not GRADER_NAME.fullmatch(name):
            raise GraderConfigError(
                "a grader name must be 1-64 letters, digits, '_', '.' or '-' (it is part of /grade/{name})",
                source=source,
                grader=str(name),
            )
        if name in context.state_checks:
            pack = context.state_checks[name][0].name
            raise GraderConfigError(
                f"the name is taken by the state check of pack {pack!r}, which is served as a grader "
                "already; choose another name",
                source=source,
                grader=name,
            )
        builder = _Builder(source=source, grader=name, context=context)
        try:
            spec = parse_spec(raw)
        except SpecError as exc:
            raise GraderConfigError(exc.message, source=source, grader=name, field=exc.field) from None
        graders[name] = builder.build(spec, name=name, path="")
    for check_name in context.state_checks:
        graders[check_name] = _Builder(source="code", grader=check_name, context=context).state_check(
            StateCheckSpec(type="state_check", check=check_name), name=check_name, path=""
        )
    return graders


def _join(path: str, field: str) -> str:
    return f"{path}.{field}" if path else field


def _check_fingerprint(pack: Pack, check: StateCheck) -> str:
    """Part of a state check grader's version: the check's code, so regrading notices a changed check."""
    try:
        code = inspect.getsource(check)
    except (OSError, TypeError):
        code = getattr(check, "__qualname__", repr(check))
    return f"{pack.name}:{hashlib.sha256(code.encode()).hexdigest()[:16]}"


class _Builder:
    """Turns validated specs into graders, reporting problems against one grader of one source."""

    def __init__(self, *, source: str, grader: str, context: GraderContext) -> None:
        self.source = source
        self.grader = grader
        self.context = context

    def error(self, field: str, message: str) -> GraderConfigError:
        return GraderConfigError(message, source=self.source, grader=self.grader, field=field)

    def template(self, text: str, field: str) -> Template:
        try:
            return compile_template(text)
        except TemplateError as exc:
            raise self.error(field, str(exc)) from None

    def version(self, spec: GraderSpec) -> str:
        checks: list[StateCheckSpec] = []
        if isinstance(spec, StateCheckSpec):
            checks.append(spec)
        elif isinstance(spec, MultiSpec):
            checks.extend(s for s in spec.graders.values() if isinstance(s, StateCheckSpec))
        extra = [
            _check_fingerprint(*self.context.state_checks[c.check])
            for c in checks
            if c.check in self.context.state_checks
        ]
        return spec_version(spec, *extra)

    def need_judge(self, field: str, what: str) -> None:
        if not self.context.judge_settings.configured:
            raise self.error(
                field,
                f"{what} needs a judge endpoint: set SPARRING_JUDGE_API_KEY (OpenAI) and/or "
                "SPARRING_JUDGE_BASE_URL (any OpenAI-compatible server)",
            )

    def build(self, spec: GraderSpec, *, name: str, path: str) -> Grader:
        """The grader for `spec`; `path` is where the spec sits in the config ("" or "graders.<key>")."""

        def at(field: str) -> str:
            return _join(path, field)

        version = self.version(spec)
        if isinstance(spec, StringCheckSpec):
            return StringCheckGrader(
                name=name,
                version=version,
                operation=spec.operation,
                input=self.template(spec.input, at("input")),
                reference=self.template(spec.reference, at("reference")),
            )
        if isinstance(spec, TextSimilaritySpec):
            return self.text_similarity(spec, name=name, version=version, path=path)
        if isinstance(spec, ScoreModelSpec | LabelModelSpec):
            return self.model_grader(spec, name=name, version=version, path=path)
        if isinstance(spec, PythonSpec):
            try:
                return PythonGrader(
                    name=name, version=version, source=spec.source, runner=self.context.python_pool
                )
            except PythonSourceError as exc:
                raise self.error(at("source"), str(exc)) from None
        if isinstance(spec, MultiSpec):
            return self.multi(spec, name=name, version=version)
        if isinstance(spec, ToolBudgetSpec):
            return ToolBudgetGrader(name=name, version=version, max_calls=spec.max_calls, decay=spec.decay)
        if isinstance(spec, NoLoopsSpec):
            return NoLoopsGrader(
                name=name,
                version=version,
                allowed_repeats=spec.allowed_repeats,
                same_output_only=spec.same_output_only,
            )
        if isinstance(spec, GroundedSpec):
            return GroundedGrader(
                name=name,
                version=version,
                input=self.template(spec.input, at("input")) if spec.input is not None else None,
                include_prompt=spec.include_prompt,
                ignore_numbers_below=spec.ignore_numbers_below,
            )
        if isinstance(spec, RequiredToolsSpec):
            return RequiredToolsGrader(name=name, version=version, tools=spec.tools)
        if isinstance(spec, ForbiddenToolsSpec):
            return ForbiddenToolsGrader(name=name, version=version, tools=spec.tools)
        return self.state_check(spec, name=name, path=path)

    def text_similarity(self, spec: TextSimilaritySpec, *, name: str, version: str, path: str) -> Grader:
        input_template = self.template(spec.input, _join(path, "input"))
        reference = self.template(spec.reference, _join(path, "reference"))
        if spec.evaluation_metric == "cosine":
            self.need_judge(_join(path, "evaluation_metric"), "the cosine metric (embeddings)")
            return TextSimilarityGrader(
                name=name,
                version=version,
                metric_name="cosine",
                input=input_template,
                reference=reference,
                embedder=self.context.judge,
                embedding_model=spec.embedding_model,
            )
        try:
            metric = local_metric(spec.evaluation_metric)
        except MetricUnavailable as exc:
            raise self.error(_join(path, "evaluation_metric"), str(exc)) from None
        return TextSimilarityGrader(
            name=name,
            version=version,
            metric_name=spec.evaluation_metric,
            input=input_template,
            reference=reference,
            metric=metric,
        )

    def model_grader(
        self, spec: ScoreModelSpec | LabelModelSpec, *, name: str, version: str, path: str
    ) -> Grader:
        self.need_judge(_join(path, "model"), f"a {spec.type} grader")
        messages = compile_messages(spec.input, lambda text, field: self.template(text, _join(path, field)))
        common: dict[str, Any] = {
            "name": name,
            "version": version,
            "judge": self.context.judge,
            "model": spec.model,
            "messages": messages,
        }
        if isinstance(spec, ScoreModelSpec):
            return ScoreModelGrader(
                params=chat_params(spec.sampling_params), score_range=spec.range, **common
            )
        return LabelModelGrader(params={}, labels=spec.labels, passing_labels=spec.passing_labels, **common)

    def multi(self, spec: MultiSpec, *, name: str, version: str) -> Grader:
        try:
            formula = compile_formula(spec.calculate_output, spec.graders.keys())
        except FormulaSyntaxError as exc:
            raise self.error("calculate_output", str(exc)) from None
        graders = {
            key: self.build(sub, name=f"{name}.{key}", path=f"graders.{key}")
            for key, sub in spec.graders.items()
        }
        return MultiGrader(name=name, version=version, graders=graders, formula=formula)

    def state_check(self, spec: StateCheckSpec, *, name: str, path: str) -> Grader:
        entry = self.context.state_checks.get(spec.check)
        if entry is None:
            known = ", ".join(sorted(self.context.state_checks)) or "none (no enabled pack registers one)"
            raise self.error(
                _join(path, "check"),
                f"unknown state check {spec.check!r}; the registered ones are: {known}",
            )
        pack, check = entry
        return StateCheckGrader(
            name=name,
            version=self.version(spec),
            check_name=spec.check,
            pack=pack,
            check=check,
            make_state=self.context.pack_state,
        )


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's SafeLoader, but a key given twice is an error instead of the last one silently winning."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error on one line: what is wrong and where (PyYAML's own text spans several)."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"


def load_graders_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """A graders file (YAML, or JSON for a .json name): a mapping of grader name -> grader config."""
    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise GraderConfigError(
            f"cannot read the graders file: {exc.strerror or exc}", source=where, grader=""
        ) from None
    try:
        if Path(path).suffix.lower() == ".json":
            data = orjson.loads(text) if text.strip() else None
        else:
            data = yaml.load(text, Loader=_UniqueKeyLoader)
    except orjson.JSONDecodeError as exc:
        raise GraderConfigError(f"not valid JSON: {exc}", source=where, grader="") from None
    except yaml.YAMLError as exc:
        raise GraderConfigError(f"not valid YAML: {_yaml_problem(exc)}", source=where, grader="") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise GraderConfigError(
            f"the file must hold a mapping of grader name -> config, not a {type(data).__name__}",
            source=where,
            grader="",
        )
    configs: dict[str, dict[str, Any]] = {}
    for name, config in data.items():
        if not isinstance(config, dict):
            raise GraderConfigError(
                f"a grader config must be a mapping, not a {type(config).__name__}",
                source=where,
                grader=str(name),
            )
        configs[str(name)] = config
    return configs
