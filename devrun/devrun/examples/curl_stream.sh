#!/usr/bin/env bash
# Stream a chat completion with curl and print the raw server-sent events (`data: {...}` ... `data: [DONE]`).
#   examples/curl_stream.sh [BASE_URL] [PROMPT]      (set COLIBRI_API_KEY when the server runs with --api-key)
# The prompt is pasted into JSON as is: keep double quotes and backslashes out of it.
set -euo pipefail
base_url=${1:-http://127.0.0.1:8000}
prompt=${2:-Write a haiku about hummingbirds.}
auth=()
[[ -n "${COLIBRI_API_KEY:-}" ]] && auth=(-H "Authorization: Bearer ${COLIBRI_API_KEY}")
curl -sS -N --fail-with-body "${auth[@]}" -H "Content-Type: application/json" "${base_url}/v1/chat/completions" \
  -d "{\"messages\": [{\"role\": \"user\", \"content\": \"${prompt}\"}], \"max_tokens\": 64, \"stream\": true, \"stream_options\": {\"include_usage\": true}}"
