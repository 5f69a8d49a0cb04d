"""Python's own TypeError for a wrong keyword to a native class or function ("X() got an
unexpected keyword argument 'y'", "X() missing required argument 'z'") instead of pybind11's
generic "incompatible function arguments"."""
from __future__ import annotations

import functools
import re

_PARAMETER = re.compile(r"[(,]\s*(\w+)\s*:[^,()\[\]]*?(=)?")


def _signatures(doc, name):
    """[(parameter names, required names)] of each overload in a pybind11 docstring."""
    out = []
    for line in (doc or "").splitlines():
        line = re.sub(r"^\d+\.\s*", "", line.strip())
        if not line.startswith(name + "(") or "**kwargs" in line:
            continue
        inside = line[len(name):line.rfind(")") + 1]
        params = [(m.group(1), m.group(2) is None) for m in _PARAMETER.finditer(inside)]
        params = [(p, req) for p, req in params if p != "self"]
        out.append(([p for p, _ in params], [p for p, req in params if req]))
    return out


def _explain(display, signatures, args, kwargs):
    if not signatures:
        return None
    known = set().union(*(set(names) for names, _ in signatures))
    for key in kwargs:
        if key not in known:
            return f"{display}() got an unexpected keyword argument '{key}'"
    if len(signatures) == 1:
        names, required = signatures[0]
        given = set(names[:len(args)]) | set(kwargs)
        missing = [p for p in required if p not in given]
        if missing:
            return f"{display}() missing required argument '{missing[0]}'"
    return None


def _wrap(function, doc_name, display):
    signatures = _signatures(getattr(function, "__doc__", ""), doc_name)
    if not signatures:
        return function

    @functools.wraps(function)
    def checked(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except TypeError as error:
            if "incompatible" not in str(error):
                raise
            # A method's first argument is self.
            explanation = _explain(display, signatures, args[1:] if doc_name == "__init__" else args, kwargs)
            if explanation is None:
                raise
            raise TypeError(explanation) from None
    return checked


def name_wrong_keywords(module, functions=True):
    """Wraps the constructors of the native classes and (with `functions`) the functions of
    a native module (not the tensor operations: each call would pay for the wrapper)."""
    for attribute in list(vars(module)):
        value = getattr(module, attribute)
        if isinstance(value, type) and "__init__" in vars(value) and value.__module__.startswith("tessera"):
            value.__init__ = _wrap(vars(value)["__init__"], "__init__", value.__name__)
        elif functions and type(value).__name__ == "builtin_function_or_method" and not attribute.startswith("_"):
            setattr(module, attribute, _wrap(value, attribute, f"{module.__name__.split('.')[-1]}.{attribute}"))
