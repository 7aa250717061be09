"""What a W&B run started here would find (preflight `wandb`): wandb installed for this Python, an API key for
the server, and the server answering. Stdlib only; the key's value is never printed.

Usage: python - 'JSON_ARGS' (script on stdin; prints one JSON line). JSON_ARGS: {"base_url": V4_WANDB_BASE_URL
("" = what wandb itself would use: WANDB_BASE_URL, the base_url of its settings file, its default), "timeout":
seconds}. Output: {"version", "base_url", "base_from", "key_from" (where the key was found, "" for
none), "looked" (where it was looked for), "answered", "status" (the HTTP status, any status: the server
answered), "seconds", "error"}.

The key is looked for where wandb looks (wandb/sdk/lib/wbauth: `_try_env_auth`, `read_netrc_auth_with_source`):
WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, the netrc file (NETRC, else ~/.netrc) entry for the server's host[:port]
(or, for a CoreWeave Forge address, the W&B host behind it), then the api_key of wandb's settings file. wandb's
default server and that mapping come from the installed wandb (its default changed from api.wandb.ai to
api.forge.coreweave.com), read from `wandb.sdk.lib.urls` when it has them.
"""
import configparser
import json
import netrc
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_URL = "https://api.wandb.ai"          # wandb before 0.31's Forge default
args = json.loads(sys.argv[1])
timeout = float(args["timeout"])
out = {"version": None, "base_url": "", "base_from": "", "key_from": "", "looked": [], "answered": False,
       "status": None, "seconds": None, "error": ""}
try:
    out["version"] = metadata.version("wandb")
except metadata.PackageNotFoundError:
    pass


def upstream(url):
    return url


if out["version"]:
    try:
        from wandb.sdk.lib import urls as wandb_urls
        DEFAULT_URL = wandb_urls.DEFAULT_BASE_URL
        upstream = getattr(wandb_urls, "forge_upstream_url", upstream)
    except Exception:   # noqa: BLE001 - an older or broken wandb: the fallbacks above
        pass

# wandb's global settings file ([default] section): `wandb login --host` and `wandb init` write it
settings_path = Path(os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb") / "settings"
file_settings = {}
try:
    parser = configparser.ConfigParser()
    parser.read(settings_path)
    if parser.has_section("default"):
        file_settings = dict(parser.items("default"))
except (configparser.Error, OSError):
    pass

if args.get("base_url"):
    out["base_url"], out["base_from"] = args["base_url"], "V4_WANDB_BASE_URL"
elif os.environ.get("WANDB_BASE_URL"):
    out["base_url"], out["base_from"] = os.environ["WANDB_BASE_URL"], "WANDB_BASE_URL"
elif file_settings.get("base_url"):
    out["base_url"], out["base_from"] = file_settings["base_url"], str(settings_path)
else:
    out["base_url"], out["base_from"] = DEFAULT_URL, "W&B's default"
base = out["base_url"].rstrip("/")
parts = urlsplit(base)

# --- the key ------------------------------------------------------------------------------------
netrc_path = Path(os.environ["NETRC"]).expanduser() if os.environ.get("NETRC") else Path.home() / ".netrc"
out["looked"] = ["WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", f"{netrc_path} (machine {parts.netloc or '?'})",
                 f"{settings_path} (api_key)"]
if os.environ.get("WANDB_API_KEY"):
    out["key_from"] = "WANDB_API_KEY"
elif os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
    token = os.environ["WANDB_IDENTITY_TOKEN_FILE"]
    if Path(token).is_file():
        out["key_from"] = f"WANDB_IDENTITY_TOKEN_FILE ({token})"
    else:
        out["looked"][1] = f"WANDB_IDENTITY_TOKEN_FILE ({token}: no such file)"
if not out["key_from"] and parts.netloc and netrc_path.is_file():
    try:
        entries = netrc.netrc(str(netrc_path))
        creds = entries.authenticators(parts.netloc) or entries.authenticators(urlsplit(upstream(base)).netloc)
        if creds and creds[2]:
            out["key_from"] = str(netrc_path)
    except (netrc.NetrcParseError, OSError) as e:
        out["looked"][2] = f"{netrc_path} (unreadable: {e})"
if not out["key_from"] and file_settings.get("api_key"):
    out["key_from"] = str(settings_path)

# --- the server: any HTTP answer within the timeout -----------------------------------------------
if parts.scheme not in ("http", "https") or not parts.netloc:
    out["error"] = f"{base!r} is not an http(s) URL"
else:
    result = {}

    def ask():
        t0 = time.time()
        try:
            # the environment's proxies apply, as they do to wandb
            with urllib.request.urlopen(base + "/healthz", timeout=timeout) as r:
                result["status"] = r.status
        except urllib.error.HTTPError as e:
            result["status"] = e.code
        except Exception as e:   # noqa: BLE001 - refused, timed out, no such host, TLS: all "did not answer"
            result["error"] = f"{type(e).__name__}: {getattr(e, 'reason', None) or e}"
        result["seconds"] = time.time() - t0

    # in a thread: the socket timeout does not bound the name lookup
    worker = threading.Thread(target=ask, daemon=True)
    worker.start()
    worker.join(timeout + 1)
    if worker.is_alive():
        out["error"] = f"no answer within {timeout:g} s"
    elif "status" in result:
        out.update(answered=True, status=result["status"], seconds=round(result["seconds"], 3))
    else:
        out["error"] = result["error"]
print(json.dumps(out))
