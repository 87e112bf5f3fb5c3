"""The one place the runner layer reads gin's private state (gin-config 0.5).

gin has public calls for what a runner does with a configuration (parse, bind, query one
binding: `gin.get_bindings`, `gin.query_parameter`, `gin.add_config_file_search_path`),
but none for what the checks and `--help` need to see all of it:

  * every (scope, configurable) that has bindings: `gin.config._CONFIG`;
  * every registered configurable, and the one a selector names, with its name, the
    function or class it wraps and its denylist: `gin.config._REGISTRY`;
  * the directories an `include` is searched in, in gin's order (the pre-parse scanner
    follows includes as gin will): `gin.config._LOCATION_PREFIXES`; and the repository's
    gin/ put first there: the public `gin.add_config_file_search_path` appends, and gin
    then logs "ERROR ... Path not found" on stderr for every earlier prefix an include
    misses, before it finds the file in gin/.

Everything else in attnprec.ginutils goes through this module or gin's public API, so a
gin upgrade that moves these is one file to fix.
"""
from typing import Dict, Iterator, List, Optional, Tuple

from gin import config as _config


def bound() -> Dict[Tuple[str, str], Dict[str, object]]:
  """{(scope, complete selector): {arg: value}}: every binding gin parsed, references
  and macros unresolved (a macro's definition is (its name, 'gin.macro'))."""
  return _config._CONFIG  # noqa: SLF001


def lookup(selector: str) -> Optional[_config.Configurable]:
  """The registered configurable a (possibly partial) selector names, or None."""
  return _config._REGISTRY.get_match(selector)  # noqa: SLF001


def registered() -> Iterator[Tuple[str, _config.Configurable]]:
  """(complete selector, configurable) for every registered configurable."""
  return iter(list(_config._REGISTRY.items()))  # noqa: SLF001


def minimal_selector(selector: str) -> str:
  """The shortest selector that names `selector` without ambiguity (as users write it)."""
  return _config._REGISTRY.minimal_selector(selector)  # noqa: SLF001


def search_path() -> List[str]:
  """The prefixes gin tries, in order, for a relative `include` or gin file."""
  return list(_config._LOCATION_PREFIXES)  # noqa: SLF001


def search_first(directory: str) -> None:
  """Puts `directory` first among the prefixes gin searches (once)."""
  prefixes = _config._LOCATION_PREFIXES  # noqa: SLF001
  if directory not in prefixes:
    prefixes.insert(0, directory)
