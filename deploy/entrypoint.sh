#!/bin/sh
# Container entrypoint: wait for the database, migrate, then serve.
#
#   (no argument) or `serve`   wait for the database, `sparring db upgrade`, then serve with
#                              ${SPARRING_WORKERS:-2} worker processes on
#                              ${SPARRING_HOST:-0.0.0.0}:${SPARRING_PORT:-8000} (set SPARRING_HOST=127.0.0.1
#                              with `--network host` to keep the port off the host's interfaces)
#   `migrate`                  wait for the database and migrate, then exit (a Kubernetes Job or
#                              init container)
#   anything else              run as given, e.g. `sparring job-config` or `sparring tools`
#
# Replicas starting together may all run `sparring db upgrade`: the migration environment holds a
# Postgres advisory lock, so the first one migrates and the others find the schema at head.
set -eu

wait_for_database() {
    # Settings come from app.config (the one place that reads SPARRING_*), so the URL checked here is
    # exactly the one the server will use. The embedded SQLite default has nothing to wait for.
    python - "${DB_WAIT_SECONDS:-60}" <<'PY'
import asyncio
import sys
import time

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from app.config import get_settings

settings = get_settings()
if settings.is_embedded_db:
    sys.exit(0)
url = settings.effective_database_url
shown = make_url(url).render_as_string(hide_password=True)
deadline = time.monotonic() + float(sys.argv[1])


async def ping() -> None:
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    finally:
        await engine.dispose()


attempt = 0
while True:
    attempt += 1
    try:
        asyncio.run(asyncio.wait_for(ping(), timeout=5))
    except Exception as exc:
        if time.monotonic() >= deadline:
            print(f"entrypoint: database {shown} still unreachable: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            sys.exit(1)
        if attempt == 1 or attempt % 10 == 0:
            print(f"entrypoint: waiting for database {shown} ({type(exc).__name__})", file=sys.stderr)
        time.sleep(1)
    else:
        print(f"entrypoint: database {shown} is up", file=sys.stderr)
        break
PY
}

case "${1:-serve}" in
    serve)
        wait_for_database
        sparring db upgrade
        exec sparring serve --host "${SPARRING_HOST:-0.0.0.0}" --workers "${SPARRING_WORKERS:-2}"
        ;;
    migrate)
        wait_for_database
        exec sparring db upgrade
        ;;
    *)
        exec "$@"
        ;;
esac
