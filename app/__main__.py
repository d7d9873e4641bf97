"""``python -m app [--flags]``: every setting is a flag (``--pool-bytes``) and an environment
variable (``FEATPOOL_POOL_BYTES``)."""

from __future__ import annotations

import sys

import uvicorn
from pydantic import ValidationError
from pydantic_settings import CliApp, SettingsConfigDict

from app import logs
from app.main import create_app
from app.settings import Settings


class CliSettings(Settings):
    model_config = SettingsConfigDict(env_prefix="FEATPOOL_", extra="forbid",
                                      cli_kebab_case=True, cli_prog_name="featpool",
                                      cli_implicit_flags=True)


def main(argv: list[str] | None = None) -> None:
    try:
        settings = CliApp.run(CliSettings, cli_args=sys.argv[1:] if argv is None else argv)
    except ValidationError as e:
        sys.exit(f"featpool: invalid settings:\n{e}")
    logs.setup(settings.log_level, settings.log_json)
    # The batch thread launches GPU work and publishes leases while the event loop parses HTTP.
    # A thread that gave up the GIL (in a CUDA driver call, say) waits up to the switch interval
    # to get it back from a busy thread: 5 ms by default, longer than a whole batch's forward.
    sys.setswitchinterval(0.0005)
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_config=None,
                access_log=False, timeout_graceful_shutdown=10)


if __name__ == "__main__":
    main()
