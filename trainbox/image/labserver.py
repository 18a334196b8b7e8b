"""JupyterLab's own launcher with one check added: the resolved server settings must require authentication.

`trainbox jupyter` runs this instead of `python -m jupyterlab`. jupyterlab parses its command line and every
jupyter_server_config file as usual; the check runs in `start_app`, after all configuration is resolved and before
the event loop starts (jupyter_server binds its socket from the loop), so a server that would let anyone in exits 2
without having served a single request. What it refuses, each with what to remove:
- no token and no password (e.g. `IdentityProvider.token = ""` in a config file, or `-- --IdentityProvider.token=`);
- an identity provider that isn't jupyter_server's own (it could let anyone in; we can't tell);
- `ServerApp.disable_check_xsrf` (a page on another site could then drive the server with the user's cookie);
- `ServerApp.allow_unauthenticated_access` turned back on (we turn it off: handlers without an auth rule need a login);
- an address, port or UNIX socket other than the one `trainbox jupyter` was told (TRAINBOX_JUPYTER_BIND): the
  wrapper probes that address after start, and a config file moving the server elsewhere would dodge the probe.
"""

from __future__ import annotations

import json
import os
import sys

BIND_ENV = "TRAINBOX_JUPYTER_BIND"  # {"ip": ..., "port": ...}: what the wrapper asked for and will probe


def insecure_settings(app, bind: dict | None) -> list[str]:
    """Why this resolved ServerApp must not start; [] when it may."""
    from jupyter_server.auth.identity import IdentityProvider, LegacyIdentityProvider, PasswordIdentityProvider

    idp = app.identity_provider
    why = []
    if type(idp) not in (IdentityProvider, PasswordIdentityProvider, LegacyIdentityProvider):
        why.append(f"ServerApp.identity_provider_class is {type(idp).__module__}.{type(idp).__name__}, not "
                   "jupyter_server's own: remove that setting")
    elif not idp.auth_enabled or not (idp.token or getattr(idp, "hashed_password", "")):
        why.append("authentication is off (no token and no password): remove the setting that empties it "
                   "(IdentityProvider.token / ServerApp.token / PasswordIdentityProvider.hashed_password, in a "
                   "jupyter_server_config file or after `--`); the token comes from JUPYTER_TOKEN, "
                   "JUPYTER_TOKEN_FILE or JUPYTER_PASSWORD_HASH")
    if app.disable_check_xsrf:
        why.append("ServerApp.disable_check_xsrf is on: remove it")
    if app.allow_unauthenticated_access:
        why.append("ServerApp.allow_unauthenticated_access is on: remove it")
    if bind is not None:
        if app.sock:
            why.append("ServerApp.sock is set: remove it (trainbox jupyter serves on --ip/--port)")
        if (app.ip, app.port) != (bind["ip"], bind["port"]):
            why.append(f"the server would listen on {app.ip}:{app.port}, not the {bind['ip']}:{bind['port']} "
                       "trainbox jupyter checks: remove ServerApp.ip/ServerApp.port from the config and after "
                       "`--`, use --ip/--port")
    return why


def guarded_server_class():
    from jupyter_server import serverapp

    class ServerApp(serverapp.ServerApp):  # the same name: the server's log lines stay as users know them
        def start_app(self) -> None:
            raw = os.environ.get(BIND_ENV)
            why = insecure_settings(self, json.loads(raw) if raw else None)
            if why:
                print(f"trainbox jupyter: error: refusing to start: {'; '.join(why)}", file=sys.stderr, flush=True)
                sys.exit(2)
            super().start_app()

    return ServerApp


def main(argv: list[str]) -> None:
    import warnings

    from jupyter_server.utils import JupyterServerAuthWarning
    from jupyterlab.labapp import LabApp

    # "Extension endpoints without @allow_unauthenticated ...": with allow_unauthenticated_access off (above) those
    # endpoints need a login like every other, so the warning describes a hole that isn't there.
    warnings.filterwarnings("ignore", category=JupyterServerAuthWarning)

    # A class attribute, not a LabApp subclass: jupyterlab names its extension after the class's module.
    LabApp.serverapp_class = guarded_server_class()
    LabApp.launch_instance(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
