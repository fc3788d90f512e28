#!/bin/sh
# compose's grafana service starts here, then runs the image's own entrypoint ("$@": /run.sh).
# Grafana's admin password has no well-known default: SPLITSERVE_GRAFANA_PASSWORD (handed in as
# GF_SECURITY_ADMIN_PASSWORD) when set, else a random one made at the first start and kept in
# the data volume, where `docker compose exec grafana cat /var/lib/grafana/admin-password` reads
# it. Grafana takes the password only when it creates its database (the first start).
set -eu
file="$GF_PATHS_DATA/admin-password"
if [ -z "${GF_SECURITY_ADMIN_PASSWORD:-}" ]; then
    if [ ! -s "$file" ] && [ -e "$GF_PATHS_DATA/grafana.db" ]; then
        # A database made before this script: a password made now would not be Grafana's.
        echo "grafana: this database predates $file and keeps its admin password (admin / admin unless" \
             "changed); set another with: docker compose exec grafana grafana cli admin reset-admin-password <password>" >&2
    else
        # (tr and head: in busybox and coreutils alike, whichever base the image has)
        [ -s "$file" ] || (umask 077 && LC_ALL=C tr -dc a-z0-9 < /dev/urandom | head -c 32 > "$file")
        GF_SECURITY_ADMIN_PASSWORD=$(cat "$file")
        export GF_SECURITY_ADMIN_PASSWORD
        echo "grafana: the admin password is in $file (docker compose exec grafana cat $file)"
    fi
fi
exec "$@"
