{{/* Names, labels, images and the config file of the bapo chart. */}}

{{- define "bapo.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-bapo, or the release name when it already says bapo. */}}
{{- define "bapo.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "bapo.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Names of the per-component objects: (dict "root" $ "component" "buffer"). */}}
{{- define "bapo.componentName" -}}
{{- printf "%s-%s" (include "bapo.fullname" .root | trunc 50 | trimSuffix "-") .component -}}
{{- end -}}

{{- define "bapo.selectorLabels" -}}
app.kubernetes.io/name: {{ include "bapo.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of the release as a whole (no component). */}}
{{- define "bapo.releaseLabels" -}}
app.kubernetes.io/name: {{ include "bapo.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: bapo
helm.sh/chart: {{ include "bapo.chart" . }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "bapo.labels" -}}
{{ include "bapo.releaseLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "bapo.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "bapo.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The image of a component: (dict "root" $ "gpus" N). */}}
{{- define "bapo.image" -}}
{{- $v := .root.Values -}}
{{- $tag := default .root.Chart.AppVersion $v.image.tag -}}
{{- if gt (int .gpus) 0 -}}
{{- printf "%s:%s" (default $v.image.repository $v.gpuImage.repository) (default (printf "%s-cuda" $tag) $v.gpuImage.tag) -}}
{{- else -}}
{{- printf "%s:%s" $v.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/*
Client addresses of the two gRPC servers: <svc>.<ns>.svc, a name the
servers' certificates carry (bapo verifies the URL's host). https under
mutual TLS, http with insecure.
*/}}
{{- define "bapo.grpcScheme" -}}
{{- ternary "https" "http" (and .Values.tls.enabled (not .Values.insecure)) -}}
{{- end -}}
{{- define "bapo.bufferUrl" -}}
{{- printf "%s://%s.%s.svc:%d" (include "bapo.grpcScheme" .) (include "bapo.componentName" (dict "root" . "component" "buffer")) .Release.Namespace (int .Values.ports.bufferGrpc) -}}
{{- end -}}
{{- define "bapo.learnerUrl" -}}
{{- printf "%s://%s.%s.svc:%d" (include "bapo.grpcScheme" .) (include "bapo.componentName" (dict "root" . "component" "learner")) .Release.Namespace (int .Values.ports.learnerGrpc) -}}
{{- end -}}
{{/*
The reward server's address in the actors' [reward] endpoint: grpcs:// (TLS,
the actors verify that host in its certificate) under mutual TLS, grpc://
with insecure.
*/}}
{{- define "bapo.rewardUrl" -}}
{{- $scheme := ternary "grpcs" "grpc" (and .Values.tls.enabled (not .Values.insecure)) -}}
{{- printf "%s://%s.%s.svc:%d" $scheme (include "bapo.componentName" (dict "root" . "component" "reward")) .Release.Namespace (int .Values.reward.port) -}}
{{- end -}}

{{/*
Refuses incomplete reward values; included by configmap.yaml (and the
reward Deployment names the image's parts again with `required`).
*/}}
{{- define "bapo.reward.validate" -}}
{{- $r := .Values.reward -}}
{{- if $r.enabled -}}
{{- if not $r.image.repository -}}
{{- fail "reward.image.repository is required when reward.enabled is true: the image of your reward server (e.g. one built from examples/reward-server, docs/deploy.md#bring-your-own-reward)" -}}
{{- end -}}
{{- if not $r.image.tag -}}
{{- fail "reward.image.tag is required when reward.enabled is true: the tag of your reward server's image" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The actors' [reward] table, when the chart runs the reward server. */}}
{{- define "bapo.rewardToml" -}}
{{- $r := .Values.reward -}}
# The reward server of this release (reward.enabled): Service
# {{ include "bapo.componentName" (dict "root" . "component" "reward") }}, port {{ $r.port }}.
[reward]
endpoint = {{ include "bapo.rewardUrl" . | toJson }}
{{- if and .Values.tls.enabled (not .Values.insecure) }}
ca = {{ include "bapo.tls.caFile" . | toJson }}
{{- if $r.clientAuthArgs }}
# The server requires a client certificate (--client-ca): each actor
# presents its own.
cert = {{ printf "%s/tls.crt" (include "bapo.tls.dir" .) | toJson }}
key = {{ printf "%s/tls.key" (include "bapo.tls.dir" .) | toJson }}
{{- end }}
{{- else }}
insecure = true
{{- end }}
timeout_ms = {{ include "bapo.tomlValue" $r.timeoutMs }}
retries = {{ include "bapo.tomlValue" $r.retries }}
backoff_ms = {{ include "bapo.tomlValue" $r.backoffMs }}
concurrency = {{ include "bapo.tomlValue" $r.concurrency }}
send_tokens = {{ include "bapo.tomlValue" $r.sendTokens }}
{{- end -}}

{{/*
The environment server's address in the actors' [actor.env] endpoint:
grpcs:// (TLS, the actors verify that host in its certificate) under mutual
TLS, grpc:// with insecure.
*/}}
{{- define "bapo.envUrl" -}}
{{- $scheme := ternary "grpcs" "grpc" (and .Values.tls.enabled (not .Values.insecure)) -}}
{{- printf "%s://%s.%s.svc:%d" $scheme (include "bapo.componentName" (dict "root" . "component" "env")) .Release.Namespace (int .Values.env.port) -}}
{{- end -}}

{{/*
Refuses env values that cannot work; included by configmap.yaml (and the
env Deployment names the image's parts again with `required`). The actor
refuses a [reward] endpoint together with [actor.env] (an environment
rewards its own episodes), so the chart refuses reward.enabled, a
config.reward endpoint and a [reward] endpoint in configOverride with it;
and it writes [actor.env] itself, so it refuses one of yours.
*/}}
{{- define "bapo.env.validate" -}}
{{- $e := .Values.env -}}
{{- if $e.enabled -}}
{{- if .Values.reward.enabled -}}
{{- fail "env.enabled and reward.enabled are both true: the actor refuses a [reward] endpoint together with [actor.env] (an environment rewards its own episodes); turn reward.enabled off (the environment server scores the episodes) or env.enabled off" -}}
{{- end -}}
{{- if not $e.image.repository -}}
{{- fail "env.image.repository is required when env.enabled is true: the image of your environment server (e.g. one built from examples/env-server, docs/deploy.md#bring-your-own-environment)" -}}
{{- end -}}
{{- if not $e.image.tag -}}
{{- fail "env.image.tag is required when env.enabled is true: the tag of your environment server's image" -}}
{{- end -}}
{{- if ge (int $e.maxObservationTokens) (int $e.maxEpisodeTokens) -}}
{{- fail (printf "env.maxObservationTokens (%d) must be below env.maxEpisodeTokens (%d): one observation would leave no room for a model turn (the actor refuses it)" (int $e.maxObservationTokens) (int $e.maxEpisodeTokens)) -}}
{{- end -}}
{{- if .Values.configOverride -}}
{{- if regexMatch "(?m)^\\s*\\[\\s*actor\\s*\\.\\s*env\\s*(\\]|\\.)" .Values.configOverride -}}
{{- fail "configOverride has an [actor.env] table while env.enabled is true: the chart writes [actor.env] (pointing the actors at its environment server); drop the table from configOverride and tune it with env.maxTurns, maxEpisodeTokens, maxObservationTokens, truncate, stepTimeoutMs, episodeTimeoutSeconds, retries, backoffMs" -}}
{{- end -}}
{{- $rw := regexFind "(?ms)^\\s*\\[\\s*reward\\s*\\][^\\[]*?^\\s*endpoint\\s*=\\s*[\"'][^\"']*[\"']" .Values.configOverride -}}
{{- if $rw -}}
{{- $ep := regexReplaceAll "(?s)^.*endpoint\\s*=\\s*[\"']([^\"']*)[\"']$" $rw "${1}" -}}
{{- if ne $ep "builtin" -}}
{{- fail (printf "configOverride sets [reward] endpoint = %q while env.enabled is true: the actor refuses a [reward] endpoint together with [actor.env] (an environment rewards its own episodes); drop the endpoint" $ep) -}}
{{- end -}}
{{- end -}}
{{- else -}}
{{- $cr := .Values.config.reward -}}
{{- if and (kindIs "map" $cr) (hasKey $cr "endpoint") (not (kindIs "invalid" $cr.endpoint)) (ne (toString $cr.endpoint) "builtin") -}}
{{- fail (printf "config.reward.endpoint (%v) is set while env.enabled is true: the actor refuses a [reward] endpoint together with [actor.env] (an environment rewards its own episodes); drop config.reward.endpoint" $cr.endpoint) -}}
{{- end -}}
{{- $ca := default dict .Values.config.actor -}}
{{- if and (kindIs "map" $ca) (hasKey $ca "env") (not (kindIs "invalid" $ca.env)) -}}
{{- fail "config.actor.env is set while env.enabled is true: the chart writes the [actor.env] table (pointing the actors at its environment server); tune it with env.maxTurns, maxEpisodeTokens, maxObservationTokens, truncate, stepTimeoutMs, episodeTimeoutSeconds, retries, backoffMs" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The actors' [actor.env] table, when the chart runs the environment server. */}}
{{- define "bapo.envToml" -}}
{{- $e := .Values.env -}}
{{- $ets := float64 $e.episodeTimeoutSeconds -}}
# The environment server of this release (env.enabled): Service
# {{ include "bapo.componentName" (dict "root" . "component" "env") }}, port {{ $e.port }}.
[actor.env]
kind = "grpc"
endpoint = {{ include "bapo.envUrl" . | toJson }}
{{- if and .Values.tls.enabled (not .Values.insecure) }}
ca = {{ include "bapo.tls.caFile" . | toJson }}
{{- if $e.clientAuthArgs }}
# The server requires a client certificate (--client-ca): each pod presents
# its own (the learner's evaluation, which reads this table too, the
# learner's).
cert = {{ printf "%s/tls.crt" (include "bapo.tls.dir" .) | toJson }}
key = {{ printf "%s/tls.key" (include "bapo.tls.dir" .) | toJson }}
{{- end }}
{{- else }}
insecure = true
{{- end }}
max_turns = {{ include "bapo.tomlValue" $e.maxTurns }}
max_episode_tokens = {{ include "bapo.tomlValue" $e.maxEpisodeTokens }}
max_observation_tokens = {{ include "bapo.tomlValue" $e.maxObservationTokens }}
truncate = {{ toJson $e.truncate }}
step_timeout_ms = {{ include "bapo.tomlValue" $e.stepTimeoutMs }}
episode_timeout_s = {{ if eq $ets (floor $ets) }}{{ printf "%d.0" (int64 $ets) }}{{ else }}{{ $ets }}{{ end }}
retries = {{ include "bapo.tomlValue" $e.retries }}
backoff_ms = {{ include "bapo.tomlValue" $e.backoffMs }}
{{- end -}}

{{/*
One TOML value. Helm reads every number in values as a float64, and
toToml writes 8 as 8.0, which an integer setting refuses; whole numbers
are written as integers here (a float setting accepts an integer).
*/}}
{{- define "bapo.tomlValue" -}}
{{- $v := . -}}
{{- if kindIs "string" $v -}}
{{- toJson $v -}}
{{- else if kindIs "bool" $v -}}
{{- ternary "true" "false" $v -}}
{{- else if or (kindIs "float64" $v) (kindIs "float32" $v) -}}
{{- if eq (float64 $v) (floor $v) -}}
{{- printf "%d" (int64 $v) -}}
{{- else -}}
{{- printf "%v" $v -}}
{{- end -}}
{{- else if or (kindIs "int" $v) (kindIs "int64" $v) -}}
{{- printf "%d" $v -}}
{{- else if kindIs "slice" $v -}}
[{{- range $i, $e := $v -}}{{- if $i -}}, {{ end -}}{{- include "bapo.tomlValue" $e -}}{{- end -}}]
{{- else -}}
{{- fail (printf "config: cannot write %v (%s) as a TOML value" $v (kindOf $v)) -}}
{{- end -}}
{{- end -}}

{{/*
One [table] of the config file, then its sub-tables as [table.sub]:
(dict "name" "actor" "table" map).
*/}}
{{- define "bapo.tomlTable" -}}
[{{ .name }}]
{{- range $k, $v := .table }}
{{- if not (kindIs "map" $v) }}
{{- if not (kindIs "invalid" $v) }}
{{ $k }} = {{ include "bapo.tomlValue" $v }}
{{- end }}
{{- end }}
{{- end }}
{{- range $k, $v := .table }}
{{- if kindIs "map" $v }}

{{ include "bapo.tomlTable" (dict "name" (printf "%s.%s" $.name $k) "table" $v) }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
The whole config file. With reward.enabled the chart's [reward] table is
added (also after configOverride), so the actors call the release's reward
server; the chart then refuses a [reward] table of its own in either. With
env.enabled the chart's [actor.env] table is added last (also after
configOverride), so the actors play episodes against the release's
environment server (bapo.env.validate refuses an [actor.env] of your own
and any [reward] endpoint then). With
actor.engine vllm, [actor] gets engine = "vllm" and the [actor.vllm] table
(the sidecar's url, the shared weights directory).
*/}}
{{- define "bapo.configToml" -}}
{{- include "bapo.vllm.validate" . -}}
{{- $rw := .Values.reward.enabled -}}
{{- if .Values.configOverride -}}
{{- if and $rw (regexMatch "(?m)^\\s*\\[\\s*reward\\s*(\\]|\\.)" .Values.configOverride) -}}
{{- fail "configOverride has a [reward] table while reward.enabled is true: the chart writes [reward] (pointing the actors at its reward server); drop the table from configOverride and tune it with reward.timeoutMs, retries, backoffMs, concurrency, sendTokens" -}}
{{- end -}}
{{- .Values.configOverride -}}
{{- if $rw }}

{{ include "bapo.rewardToml" . }}
{{- end }}
{{- if .Values.env.enabled }}

{{ include "bapo.envToml" . }}
{{- end }}
{{- else -}}
{{- $c := .Values.config -}}
{{- $b := default dict $c.buffer -}}
{{- $a := default dict $c.actor -}}
{{- $l := default dict $c.learner -}}
{{- if and (hasKey $b "group_size") (hasKey $a "group_size") (ne (toString $b.group_size) (toString $a.group_size)) -}}
{{- fail (printf "config.buffer.group_size (%v) and config.actor.group_size (%v) must be equal" $b.group_size $a.group_size) -}}
{{- end -}}
{{- if and (hasKey $b "batch_groups") (hasKey $l "batch_groups") (ne (toString $b.batch_groups) (toString $l.batch_groups)) -}}
{{- fail (printf "config.buffer.batch_groups (%v) and config.learner.batch_groups (%v) must be equal" $b.batch_groups $l.batch_groups) -}}
{{- end -}}
{{- if hasKey $c "model" -}}
{{- fail "config.model: set the model with the chart's `model` values" -}}
{{- end -}}
{{- if and $rw (hasKey $c "reward") (not (kindIs "invalid" $c.reward)) -}}
{{- fail "config.reward is set while reward.enabled is true: the chart writes the [reward] table (pointing the actors at its reward server); tune it with reward.timeoutMs, retries, backoffMs, concurrency, sendTokens" -}}
{{- end -}}
{{- if include "bapo.vllm.on" . -}}
{{- $c = deepCopy $c -}}
{{- $_ := set $c "actor" (include "bapo.vllm.actorTable" . | fromJson) -}}
{{- end -}}
{{- $shaping := default dict $a.shaping -}}
{{- if and $rw (kindIs "map" $shaping) $shaping.format_bonus (ne (toString $shaping.format_bonus) "0") -}}
{{- fail (printf "config.actor.shaping.format_bonus (%v) needs the task's own format check, which a reward service does not have: set it to 0 with reward.enabled (the service can score format itself)" $shaping.format_bonus) -}}
{{- end -}}
# Rendered by the bapo Helm chart (release {{ .Release.Name }}).
{{- range $name, $table := $c }}
{{- if not (kindIs "map" $table) }}
{{- fail (printf "config.%s must be a table (a map of settings)" $name) }}
{{- end }}

{{ include "bapo.tomlTable" (dict "name" $name "table" $table) }}
{{- end }}

[model]
{{- if .Values.model.hfDir }}
hf_dir = {{ toJson .Values.model.hfDir }}
{{- else }}
preset = {{ toJson (required "model.preset or model.hfDir is required" .Values.model.preset) }}
{{- end }}
{{- if $rw }}

{{ include "bapo.rewardToml" . }}
{{- end }}
{{- if .Values.env.enabled }}

{{ include "bapo.envToml" . }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* prometheus.io annotations of a pod, when enabled. */}}
{{- define "bapo.scrapeAnnotations" -}}
{{- if .Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.ports.metrics | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/* The env every container gets. */}}
{{- define "bapo.commonEnv" -}}
- name: RUST_LOG
  value: {{ .Values.logLevel | quote }}
- name: HOME
  value: /tmp
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end -}}

{{/* Mounts every container gets: the config file and /tmp. */}}
{{- define "bapo.commonMounts" -}}
- name: config
  mountPath: /etc/bapo
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end -}}

{{- define "bapo.commonVolumes" -}}
- name: config
  configMap:
    name: {{ include "bapo.fullname" . }}-config
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- end -}}

{{/* The model volume, when one is configured. */}}
{{- define "bapo.modelMount" -}}
{{- if .Values.model.volume.existingClaim }}
- name: model
  mountPath: {{ .Values.model.volume.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}
{{- define "bapo.modelVolume" -}}
{{- if .Values.model.volume.existingClaim }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.volume.existingClaim }}
    readOnly: true
{{- end }}
{{- end -}}

{{/* resources with the GPU request added: (dict "resources" map "gpus" N). */}}
{{- define "bapo.resources" -}}
{{- $r := deepCopy (default dict .resources) -}}
{{- if gt (int .gpus) 0 -}}
{{- $limits := default dict $r.limits -}}
{{- $_ := set $limits "nvidia.com/gpu" (int .gpus) -}}
{{- $_ := set $r "limits" $limits -}}
{{- $requests := default dict $r.requests -}}
{{- $_ := set $requests "nvidia.com/gpu" (int .gpus) -}}
{{- $_ := set $r "requests" $requests -}}
{{- end -}}
{{- toYaml $r -}}
{{- end -}}

{{/* A pod's config checksum, so a changed config rolls the pods. */}}
{{- define "bapo.configChecksum" -}}
checksum/config: {{ include "bapo.configToml" . | sha256sum }}
{{- end -}}

{{/*
The actors' scaling signal: targetReadyGroups / (ready groups, averaged),
against a target value of 1, so that an HPA asks for
replicas x targetReadyGroups / backlog: more actors while the learner
waits for data, fewer while groups pile up. Missing data reads 1 (no change).
*/}}
{{- define "bapo.readySelector" -}}
{{- $a := .Values.actor.autoscaling -}}
{{- if $a.metricSelector -}}
{{- $a.metricSelector -}}
{{- else -}}
{{- printf "state=\"ready\", namespace=\"%s\", pod=\"%s-0\"" .Release.Namespace (include "bapo.componentName" (dict "root" . "component" "buffer")) -}}
{{- end -}}
{{- end -}}
{{- define "bapo.scaleRatioQuery" -}}
{{- $a := .Values.actor.autoscaling -}}
{{- printf "(%v / clamp_min(avg_over_time(sum(bapo_buffer_groups{%s})[%s:15s]), 1)) or vector(1)" $a.targetReadyGroups (include "bapo.readySelector" .) $a.window -}}
{{- end -}}

{{/*
The vLLM engine (actor.engine vllm): an official vLLM server in a second
container of each actor pod, on 127.0.0.1, reloading the weight versions the
actor writes into a shared emptyDir through bapo's worker extension
(files/bapo_vllm_ext.py, a copy of actor/vllm/bapo_vllm_ext.py).
*/}}
{{- define "bapo.vllm.on" -}}
{{- if eq (toString .Values.actor.engine) "vllm" }}true{{ end -}}
{{- end -}}
{{/* The --served-model-name, and [actor.vllm] served_model_name. */}}
{{- define "bapo.vllm.servedModelName" -}}
bapo
{{- end -}}
{{/* Where the extension ConfigMap is mounted (the server's PYTHONPATH). */}}
{{- define "bapo.vllm.extDir" -}}
/bapo-ext
{{- end -}}
{{- define "bapo.vllm.url" -}}
{{- printf "http://127.0.0.1:%d" (int .Values.actor.vllm.port) -}}
{{- end -}}
{{/* The LoRA rank of config.learner.lora (16 when the table has none), 0 without LoRA. */}}
{{- define "bapo.lora.rank" -}}
{{- $l := get (default dict .Values.config.learner) "lora" -}}
{{- if kindIs "map" $l -}}
{{- int (default 16 (get $l "rank")) -}}
{{- else -}}
0
{{- end -}}
{{- end -}}
{{/* vLLM's --max-lora-rank for rank r: the smallest value it accepts that holds r. */}}
{{- define "bapo.vllm.maxLoraRank" -}}
{{- $r := int . -}}
{{- $found := 0 -}}
{{- range $m := list 1 8 16 32 64 128 256 320 512 -}}
{{- if and (eq $found 0) (ge $m $r) -}}
{{- $found = $m -}}
{{- end -}}
{{- end -}}
{{- $found -}}
{{- end -}}
{{/* The server's command line: (the chart's flags, LoRA's when config.learner.lora is set, then actor.vllm.extraArgs). */}}
{{- define "bapo.vllm.args" -}}
{{- $v := .Values.actor.vllm -}}
{{- $args := list "--model" .Values.model.hfDir "--served-model-name" (include "bapo.vllm.servedModelName" .) "--host" "127.0.0.1" "--port" (toString (int $v.port)) "--tensor-parallel-size" (toString (int .Values.actor.gpus)) "--enable-scale-out" "--logprobs-mode" "processed_logprobs" "--worker-extension-cls" "bapo_vllm_ext.BapoWorker" "--weight-transfer-config" "{\"backend\": \"bapo_shm\"}" "--dtype" $v.dtype -}}
{{- $rank := int (include "bapo.lora.rank" .) -}}
{{- if gt $rank 0 -}}
{{- $args = concat $args (list "--enable-lora" "--max-lora-rank" (include "bapo.vllm.maxLoraRank" $rank) "--max-loras" "2" "--max-cpu-loras" "3") -}}
{{- end -}}
{{- toYaml (concat $args (default list $v.extraArgs)) -}}
{{- end -}}
{{/* An HTTP GET of /health from inside the vLLM container (it listens on loopback only). */}}
{{- define "bapo.vllm.healthCheck" -}}
exec:
  command:
    - python3
    - -c
    - {{ printf "import urllib.request; urllib.request.urlopen('http://127.0.0.1:%d/health', timeout=%d)" (int .port) (int (max 1 (sub (int (default 5 .probe.timeoutSeconds)) 1))) | quote }}
{{ toYaml .probe }}
{{- end -}}
{{/* The extension module, from the chart's copy. */}}
{{- define "bapo.vllm.extSource" -}}
{{- $src := .Files.Get "files/bapo_vllm_ext.py" -}}
{{- if not $src -}}
{{- fail "actor.engine vllm: the chart lacks files/bapo_vllm_ext.py (a copy of actor/vllm/bapo_vllm_ext.py: cp actor/vllm/bapo_vllm_ext.py deploy/helm/bapo/files/)" -}}
{{- end -}}
{{- $src -}}
{{- end -}}

{{/*
Refuses engine values that cannot work; included by configmap.yaml and the
actor Deployment.
*/}}
{{- define "bapo.vllm.validate" -}}
{{- $a := .Values.actor -}}
{{- $v := $a.vllm -}}
{{- $engine := toString $a.engine -}}
{{- if not (has $engine (list "burn" "vllm")) -}}
{{- fail (printf "actor.engine %q is unknown: \"burn\" (bapo generates) or \"vllm\" (a vLLM container in each actor pod)" $engine) -}}
{{- end -}}
{{- $cfgActor := default dict .Values.config.actor -}}
{{- if not (kindIs "map" $cfgActor) -}}
{{- $cfgActor = dict -}}
{{- end -}}
{{- if and (hasKey $cfgActor "engine") (not (kindIs "invalid" $cfgActor.engine)) -}}
{{- fail "config.actor.engine: set the engine with actor.engine (the chart runs the vLLM container and writes [actor] engine from it)" -}}
{{- end -}}
{{- $cfgVllm := get $cfgActor "vllm" -}}
{{- if eq $engine "vllm" -}}
{{- if or (not $v.image.repository) (not $v.image.tag) -}}
{{- fail "actor.vllm.image.repository and actor.vllm.image.tag are required when actor.engine is vllm: the vLLM server image (vllm/vllm-openai at the release bapo's extension is written against)" -}}
{{- end -}}
{{- if lt (int $a.gpus) 1 -}}
{{- fail "actor.engine vllm needs actor.gpus >= 1: the GPUs of the vLLM container (vLLM does not run on the CPU image here)" -}}
{{- end -}}
{{- if not .Values.model.hfDir -}}
{{- fail "actor.engine vllm needs model.hfDir: vLLM serves a Hugging Face checkpoint directory, not a built-in preset" -}}
{{- end -}}
{{- $mp := trimSuffix "/" .Values.model.volume.mountPath -}}
{{- if not .Values.model.volume.existingClaim -}}
{{- fail "actor.engine vllm needs model.volume.existingClaim: the model must be on a volume that both the actor and the vLLM container mount" -}}
{{- end -}}
{{- if not (hasPrefix (printf "%s/" $mp) .Values.model.hfDir) -}}
{{- fail (printf "actor.engine vllm: model.hfDir %s must lie under model.volume.mountPath %s, the volume both containers mount" .Values.model.hfDir $mp) -}}
{{- end -}}
{{- $w := trimSuffix "/" $v.weightsDir -}}
{{- range $p := list $mp "/tmp" "/etc/bapo" "/etc/bapo-tls" "/etc/bapo-ca" "/etc/bapo-blocklist" "/dev/shm" (include "bapo.vllm.extDir" $) -}}
{{- if or (eq $w $p) (hasPrefix (printf "%s/" $p) $w) (hasPrefix (printf "%s/" $w) $p) -}}
{{- fail (printf "actor.vllm.weightsDir %s overlaps %s, which the pod already mounts: pick a directory of its own (the default is /weights)" $v.weightsDir $p) -}}
{{- end -}}
{{- end -}}
{{- if eq (int $v.port) (int .Values.ports.metrics) -}}
{{- fail (printf "actor.vllm.port %d is the actors' metrics port (ports.metrics): pick another" (int $v.port)) -}}
{{- end -}}
{{- range $f := default list $v.extraArgs -}}
{{- $name := regexReplaceAll "=.*$" (toString $f) "" -}}
{{- if has $name (list "--model" "--served-model-name" "--host" "--port" "--tensor-parallel-size" "-tp" "--enable-scale-out" "--logprobs-mode" "--worker-extension-cls" "--weight-transfer-config" "--dtype" "--uds" "--enable-lora" "--max-lora-rank" "--max-loras" "--max-cpu-loras") -}}
{{- fail (printf "actor.vllm.extraArgs: %s is set by the chart (model.hfDir, actor.gpus, actor.vllm.port, actor.vllm.dtype, config.learner.lora, or fixed for bapo's extension)" $name) -}}
{{- end -}}
{{- end -}}
{{- if .Values.configOverride -}}
{{- fail "configOverride with actor.engine vllm: the chart writes [actor] engine and the [actor.vllm] table (the server's url, the shared weights directory), which it cannot add to a raw file; use the `config` maps instead" -}}
{{- end -}}
{{- if $cfgVllm -}}
{{- if not (kindIs "map" $cfgVllm) -}}
{{- fail "config.actor.vllm must be a table (a map of settings)" -}}
{{- end -}}
{{- range $k := list "url" "weights_dir" "served_model_name" "dtype" "request_timeout_s" "reload_timeout_s" -}}
{{- if hasKey $cfgVllm $k -}}
{{- fail (printf "config.actor.vllm.%s is written by the chart (from actor.vllm: port, weightsDir, dtype, requestTimeoutSeconds, reloadTimeoutSeconds)" $k) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- else if $cfgVllm -}}
{{- fail "config.actor.vllm is set while actor.engine is burn: it configures the vLLM engine only (set actor.engine: vllm)" -}}
{{- end -}}
{{- end -}}

{{/* The [actor] table of the config file with the engine's settings added. */}}
{{- define "bapo.vllm.actorTable" -}}
{{- $a := deepCopy (default dict .Values.config.actor) -}}
{{- $v := .Values.actor.vllm -}}
{{- $t := deepCopy (default dict (get $a "vllm")) -}}
{{- $_ := set $t "url" (include "bapo.vllm.url" .) -}}
{{- $_ := set $t "weights_dir" $v.weightsDir -}}
{{- $_ := set $t "served_model_name" (include "bapo.vllm.servedModelName" .) -}}
{{- $_ := set $t "dtype" $v.dtype -}}
{{- $_ := set $t "request_timeout_s" $v.requestTimeoutSeconds -}}
{{- $_ := set $t "reload_timeout_s" $v.reloadTimeoutSeconds -}}
{{- $rank := int (include "bapo.lora.rank" .) -}}
{{- if gt $rank 0 -}}
{{- $_ := set $t "lora_rank" $rank -}}
{{- end -}}
{{- $_ := set $a "engine" "vllm" -}}
{{- $_ := set $a "vllm" $t -}}
{{- toJson $a -}}
{{- end -}}
