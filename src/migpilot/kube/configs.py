"""Reading a kubeconfig (or the in-cluster service account) into lightkube's config.

Why it exists: the controller, the agent, the fleet and the webhook each take ``--kubeconfig``,
and lightkube reads any YAML as one: a string, a list or a broken file ended in a traceback
that named neither the flag nor the file. :func:`load` is the one place that turns every such
file into a :class:`~migpilot.errors.ConfigError` of one line naming it; each component wraps
the config in a client (:mod:`migpilot.kube.client`).

Imports lightkube: with :mod:`~migpilot.kube.client`, the only modules that do (an import-linter
contract checks it).
"""

from __future__ import annotations

from pathlib import Path

import lightkube
import yaml

from migpilot import errors


def load(kubeconfig: Path | None) -> lightkube.KubeConfig:
    """The config in ``kubeconfig``, or the in-cluster one without a file. Raises
    :class:`~migpilot.errors.ConfigError` naming the file (or the in-cluster config)."""
    where = f"--kubeconfig {kubeconfig}" if kubeconfig is not None else "in-cluster config"
    try:
        if kubeconfig is not None:
            return lightkube.KubeConfig.from_file(kubeconfig)
        return lightkube.KubeConfig.from_env()
    except (OSError, lightkube.ConfigError, ValueError, KeyError, yaml.YAMLError) as err:
        raise errors.ConfigError(f"{where}: {' '.join(str(err).split())}") from None
    except RecursionError:  # PyYAML's loader recurses per level of nesting
        raise errors.ConfigError(f"{where}: not a kubeconfig: nested too deeply to read") from None
    except (AttributeError, TypeError):  # lightkube reads any YAML: a list, a string
        raise errors.ConfigError(
            f"{where}: not a kubeconfig (a YAML mapping with clusters, users and contexts)"
        ) from None
