"""Hypothesis strategies for sweepd's input: config documents, valid and not.

Module names in callables and entry points come from a fixed list: a
generated one could import whatever this machine has installed.
"""

from __future__ import annotations

from hypothesis import strategies as st

# Values a config might plausibly hold, valid and not, beside arbitrary ones.
PLAUSIBLE = [
    *("10s", "0s", "-1s", "1h30m", "500ms", "1d", "ten", "1e9h", "30"),
    *("*/5 * * * *", "0 0 * * *", "61 * * * *", "@reboot", "@daily"),
    *("sweepd.examples:heartbeat", "sweepd.examples:purge", "sweepd.examples:nope"),
    *("no_such_module_for_fuzz:x", "sweepd.examples.heartbeat", "not a module:x"),
    *("UTC", "Europe/Berlin", "Mars/Olympus", "2026-01-01T00:00:00Z", "2026-13-01"),
    *("latest", "earliest", "none", "auto", "never", "json", "text", "debug", "loud"),
    *("sqlite:///:memory:", "postgresql://nobody@127.0.0.1:1/x", "redis://x", "::"),
    *("127.0.0.1:0", "0.0.0.0:99999", "", "${NOPE}", "$HOME", "default", "bad name!"),
]
SWEEP_KEYS = [
    *("name", "callable", "every", "cron", "anchor", "ttl", "timeout", "jitter"),
    *("timezone", "misfire_grace", "coalesce", "catch_up", "enabled", "args", "retries"),
]
TOP_KEYS = [
    *("database", "namespace", "entrypoints", "concurrency", "drain_timeout", "defaults"),
    *("health", "logging", "history", "sweeps"),
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**12), max_value=10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(PLAUSIBLE),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from([*SWEEP_KEYS, "url", "max", "backoff", "x"]), inner, max_size=3
        )
    ),
    max_leaves=6,
)
entrypoints = st.lists(st.sampled_from(["sweepd.examples", "no_such_module_for_fuzz", "a b"]))
sweep = st.fixed_dictionaries(
    {}, optional={key: st.sampled_from(PLAUSIBLE) | values for key in SWEEP_KEYS}
)
document = st.fixed_dictionaries(
    {},
    optional={
        **{key: st.sampled_from(PLAUSIBLE) | values for key in TOP_KEYS},
        "sweeps": st.lists(sweep, max_size=3) | values,
        "entrypoints": entrypoints | values.filter(lambda v: not isinstance(v, list)),
        "databse": values,  # a misspelt key
    },
)
# Text that is not a YAML document of this shape: syntax errors, a list, a scalar.
raw_text = st.one_of(
    st.text(max_size=80),
    st.sampled_from(["sweeps: [", "- a\n- b\n", "42", "sweeps:\n\t- name: x", "{a: 1, a: 2}"]),
)
# Documents of the right shape with plausible values, most of them valid: a
# purely random one is refused at its first key nearly always.
DURATIONS = ["500ms", "1s", "10s", "1m", "1h30m"]
plausible_sweep = st.fixed_dictionaries(
    {
        "name": st.from_regex(r"[a-z][a-z0-9-]{0,10}", fullmatch=True),
        "callable": st.sampled_from(["sweepd.examples:heartbeat", "sweepd.examples:purge"]),
        "every": st.sampled_from(DURATIONS),
    },
    optional={
        "ttl": st.sampled_from(DURATIONS),
        "timeout": st.sampled_from([*DURATIONS, None]),
        "jitter": st.sampled_from(DURATIONS),
        "retries": st.fixed_dictionaries({}, optional={"max": st.integers(-1, 3)}),
        "enabled": st.booleans(),
    },
)
plausible_document = st.fixed_dictionaries(
    {"sweeps": st.lists(plausible_sweep, min_size=1, max_size=3)},
    optional={
        "concurrency": st.integers(0, 50),
        "namespace": st.sampled_from(["default", "a-b", "bad name!"]),
        "drain_timeout": st.sampled_from(DURATIONS),
        "entrypoints": entrypoints,
        "logging": st.fixed_dictionaries(
            {}, optional={"format": st.sampled_from(["json", "text", "x"])}
        ),
    },
)
configs = document | plausible_document
