#!/bin/sh
# The official images' entrypoints, as far as docker-compose.yml uses them.
#   postgres ARGS...      initialise PGDATA with POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB on
#                         first start (password auth over TCP), then run postgres with ARGS
#   redis-server ARGS...  redis-server without protected mode (the official image's default: it
#                         has no password and is reached from other containers)
#   anything else         run as given (caddy run ...)
set -eu

case "${1:-}" in
  postgres) shift ;;
  redis-server) shift; exec redis-server --protected-mode no "$@" ;;
  *) exec "$@" ;;
esac
PGDATA=${PGDATA:-/var/lib/postgresql/data}
BIN=$(ls -d /usr/lib/postgresql/*/bin | tail -n 1)
mkdir -p "$PGDATA" /run/postgresql
chown -R postgres:postgres "$PGDATA" /run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s' "$POSTGRES_PASSWORD" > "$pwfile"
  chown postgres "$pwfile"
  runuser -u postgres -- "$BIN/initdb" -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" \
    --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  runuser -u postgres -- "$BIN/pg_ctl" -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
  database=${POSTGRES_DB:-$POSTGRES_USER}
  if [ "$database" != postgres ]; then
    runuser -u postgres -- "$BIN/createdb" -U "$POSTGRES_USER" "$database"
  fi
  runuser -u postgres -- "$BIN/pg_ctl" -D "$PGDATA" -m fast -w stop >/dev/null
fi
exec runuser -u postgres -- "$BIN/postgres" -D "$PGDATA" -c listen_addresses='*' "$@"
