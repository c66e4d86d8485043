{{/*
Mutual TLS of the bapo chart: validation, identities, certificate names,
the DNS names clients use, and the volumes, mounts, flags and probes of each
component. Components: "buffer", "learner", "actor" ("admin" for the
optional operator certificate, "reward" and "env" for the optional reward
and environment servers, which serve TLS with server authentication only).
*/}}

{{/* Refuses contradictory or incomplete TLS values; included by configmap.yaml. */}}
{{- define "bapo.tls.validate" -}}
{{- $t := .Values.tls -}}
{{- $cm := $t.certManager -}}
{{- $ex := default dict $t.existingSecrets -}}
{{- if and .Values.insecure $t.enabled -}}
{{- fail "insecure: true and tls.enabled: true contradict each other: insecure turns mutual TLS off, so set tls.enabled=false with it (or leave insecure false to keep mutual TLS)" -}}
{{- end -}}
{{- if and (not .Values.insecure) (not $t.enabled) -}}
{{- fail "tls.enabled: false needs insecure: true: bapo refuses plaintext gRPC beyond loopback, so the pods would not start (for your own certificates use tls.certManager.enabled=false and tls.existingSecrets)" -}}
{{- end -}}
{{- if $t.enabled -}}
{{- if $cm.enabled -}}
{{- if or $ex.buffer $ex.learner $ex.actor $ex.reward $ex.env -}}
{{- fail "tls.existingSecrets is set while tls.certManager.enabled is true: pick one path (tls.certManager.enabled=false to use your Secrets)" -}}
{{- end -}}
{{- else -}}
{{- range $c := list "buffer" "learner" "actor" -}}
{{- if not (index $ex $c) -}}
{{- fail (printf "tls.existingSecrets.%s is required when tls.certManager.enabled is false (a Secret with tls.crt, tls.key and ca.crt)" $c) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.reward.enabled (not $ex.reward) -}}
{{- fail "tls.existingSecrets.reward is required when reward.enabled is true and tls.certManager.enabled is false (a Secret with tls.crt and tls.key for the reward server, carrying the DNS names of its Service, signed by a CA in the actors' ca.crt)" -}}
{{- end -}}
{{- if and .Values.env.enabled (not $ex.env) -}}
{{- fail "tls.existingSecrets.env is required when env.enabled is true and tls.certManager.enabled is false (a Secret with tls.crt and tls.key for the environment server, carrying the DNS names of its Service, signed by a CA in the actors' ca.crt; and, with env.clientAuthArgs, ca.crt: the CA of the actors' and the learner's certificates, unless tls.caBundle)" -}}
{{- end -}}
{{- if $cm.perPodActorIdentities -}}
{{- fail "tls.certManager.perPodActorIdentities needs tls.certManager.enabled (cert-manager's csi-driver issues them)" -}}
{{- end -}}
{{- if $cm.adminCertificate -}}
{{- fail "tls.certManager.adminCertificate needs tls.certManager.enabled" -}}
{{- end -}}
{{- end -}}
{{- if and $t.caBundle (not (contains "-----BEGIN CERTIFICATE-----" $t.caBundle)) -}}
{{- fail "tls.caBundle must be PEM certificates (-----BEGIN CERTIFICATE-----)" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The SPIFFE trust domain. */}}
{{- define "bapo.tls.trustDomain" -}}
{{- default (printf "%s.%s" (include "bapo.fullname" .) .Release.Namespace) .Values.tls.trustDomain -}}
{{- end -}}

{{/* A SPIFFE ID: (dict "root" $ "path" "actor/x"). */}}
{{- define "bapo.tls.spiffeId" -}}
{{- printf "spiffe://%s/%s" (include "bapo.tls.trustDomain" .root) .path -}}
{{- end -}}

{{/*
The SPIFFE ID path of a component's certificate: the role, then a name.
The buffer's "buffer" is no role (it only serves); harmless and readable.
*/}}
{{- define "bapo.tls.identityPath" -}}
{{- $r := .root -}}
{{- if eq .component "actor" -}}
{{- if $r.Values.tls.certManager.perPodActorIdentities -}}
actor/${POD_NAME}
{{- else -}}
{{- printf "actor/%s" (include "bapo.componentName" (dict "root" $r "component" "actor")) -}}
{{- end -}}
{{- else if eq .component "admin" -}}
{{- printf "admin/%s" (include "bapo.fullname" $r) -}}
{{- else -}}
{{- .component -}}
{{- end -}}
{{- end -}}

{{/* Key usages of a component's certificate, as a JSON list. */}}
{{- define "bapo.tls.usages" -}}
{{- if has .component (list "buffer" "reward" "env") -}}
{{- /* Servers only; the reward and environment servers verify their clients' certificates against the CA (--client-ca), not their own. */ -}}
["digital signature", "server auth"]
{{- else if eq .component "learner" -}}
{{- /* One certificate both ways: served to actors, presented to the buffer. */ -}}
["digital signature", "server auth", "client auth"]
{{- else -}}
["digital signature", "client auth"]
{{- end -}}
{{- end -}}

{{/* The issuer of the certificates: {name, kind, group}. */}}
{{- define "bapo.tls.issuerRef" -}}
{{- $ref := .Values.tls.certManager.issuerRef -}}
{{- if $ref.name -}}
name: {{ $ref.name }}
kind: {{ default "Issuer" $ref.kind }}
group: {{ default "cert-manager.io" $ref.group }}
{{- else -}}
name: {{ include "bapo.fullname" . }}-ca
kind: Issuer
group: cert-manager.io
{{- end -}}
{{- end -}}

{{/* The Secret holding a component's certificate: (dict "root" $ "component" c). */}}
{{- define "bapo.tls.secretName" -}}
{{- if .root.Values.tls.certManager.enabled -}}
{{- printf "%s-tls" (include "bapo.componentName" .) -}}
{{- else -}}
{{- index (default dict .root.Values.tls.existingSecrets) .component -}}
{{- end -}}
{{- end -}}

{{/*
DNS names of a server's certificate: (dict "root" $ "component" c). Every
form of the Service name a client may use (the chart's own URLs use
<svc>.<ns>.svc), the StatefulSet pod's stable name (buffer, learner; the
reward and environment servers are Deployments, reached through their
Services only), and
extraDnsNames.
*/}}
{{- define "bapo.tls.dnsNames" -}}
{{- $r := .root -}}
{{- $ns := $r.Release.Namespace -}}
{{- $cd := $r.Values.tls.clusterDomain -}}
{{- $svc := include "bapo.componentName" . -}}
{{- $names := list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.%s" $svc $ns $cd) -}}
{{- $governing := ternary (printf "%s-headless" $svc) $svc (eq .component "buffer") -}}
{{- if eq .component "buffer" -}}
{{- $names = concat $names (list (printf "%s.%s.svc" $governing $ns) (printf "%s.%s.svc.%s" $governing $ns $cd)) -}}
{{- end -}}
{{- if has .component (list "buffer" "learner") -}}
{{- $names = concat $names (list (printf "%s-0.%s.%s.svc" $svc $governing $ns) (printf "%s-0.%s.%s.svc.%s" $svc $governing $ns $cd)) -}}
{{- end -}}
{{- $names = concat $names (index (default dict $r.Values.tls.extraDnsNames) .component | default list) -}}
{{- toJson (uniq $names) -}}
{{- end -}}

{{/* Where the certificate files are mounted. */}}
{{- define "bapo.tls.dir" -}}/etc/bapo-tls{{- end -}}
{{- define "bapo.tls.caDir" -}}/etc/bapo-ca{{- end -}}
{{- define "bapo.tls.blocklistDir" -}}/etc/bapo-blocklist{{- end -}}

{{/*
The CA bundle a client verifies servers with (--tls-ca, and the [reward]
ca and [actor.env] ca): tls.caBundle's ConfigMap when set, else the ca.crt
of the component's own certificate volume (Secret or csi-driver).
*/}}
{{- define "bapo.tls.caFile" -}}
{{- if .Values.tls.caBundle -}}
{{- include "bapo.tls.caDir" . }}/ca.crt
{{- else -}}
{{- include "bapo.tls.dir" . }}/ca.crt
{{- end -}}
{{- end -}}

{{/*
The TLS flags of a component: (dict "root" $ "component" c). Servers
(buffer, learner) also get the blocklist. Clients verify the host of the
URL they call (no --tls-server-name).
*/}}
{{- define "bapo.tls.args" -}}
{{- $r := .root -}}
{{- if $r.Values.tls.enabled }}
- --tls-cert
- {{ include "bapo.tls.dir" $r }}/tls.crt
- --tls-key
- {{ include "bapo.tls.dir" $r }}/tls.key
- --tls-ca
- {{ include "bapo.tls.caFile" $r }}
{{- if ne .component "actor" }}
- --blocklist
- {{ include "bapo.tls.blocklistDir" $r }}/blocklist.txt
{{- end }}
{{- end }}
{{- if $r.Values.insecure }}
- --insecure
{{- end }}
{{- end -}}

{{/* The TLS mounts of a component: (dict "root" $ "component" c). */}}
{{- define "bapo.tls.mounts" -}}
{{- $r := .root -}}
{{- if $r.Values.tls.enabled }}
- name: tls
  mountPath: {{ include "bapo.tls.dir" $r }}
  readOnly: true
{{- if $r.Values.tls.caBundle }}
- name: tls-ca
  mountPath: {{ include "bapo.tls.caDir" $r }}
  readOnly: true
{{- end }}
{{- if ne .component "actor" }}
- name: blocklist
  mountPath: {{ include "bapo.tls.blocklistDir" $r }}
  readOnly: true
{{- end }}
{{- end }}
{{- end -}}

{{/*
The TLS volumes of a component: (dict "root" $ "component" c). Mounted
whole (no subPath): kubelet rewrites Secret and ConfigMap volumes in place,
and bapo re-reads them. Key files are group-readable only, for fsGroup.
*/}}
{{- define "bapo.tls.volumes" -}}
{{- $r := .root -}}
{{- $t := $r.Values.tls -}}
{{- $group := $r.Values.podSecurityContext.fsGroup -}}
{{- if $t.enabled }}
{{- if and (eq .component "actor") $t.certManager.perPodActorIdentities }}
{{- $ref := include "bapo.tls.issuerRef" $r | fromYaml }}
- name: tls
  csi:
    # cert-manager's csi-driver: a key made on the node and a certificate
    # for this pod alone, renewed in place.
    driver: csi.cert-manager.io
    readOnly: true
    volumeAttributes:
      csi.cert-manager.io/issuer-name: {{ $ref.name | quote }}
      csi.cert-manager.io/issuer-kind: {{ $ref.kind | quote }}
      csi.cert-manager.io/issuer-group: {{ $ref.group | quote }}
      csi.cert-manager.io/uri-sans: {{ include "bapo.tls.spiffeId" (dict "root" $r "path" (include "bapo.tls.identityPath" .)) | quote }}
      csi.cert-manager.io/key-usages: {{ include "bapo.tls.usages" . | fromJsonArray | join "," | quote }}
      csi.cert-manager.io/key-encoding: PKCS8
      csi.cert-manager.io/duration: {{ $t.certManager.duration | quote }}
      csi.cert-manager.io/renew-before: {{ $t.certManager.renewBefore | quote }}
      {{- with (default $r.Values.podSecurityContext.runAsGroup $group) }}
      csi.cert-manager.io/fs-group: {{ . | int | toString | quote }}
      {{- end }}
{{- else }}
- name: tls
  secret:
    secretName: {{ include "bapo.tls.secretName" . }}
    # 0440 with fsGroup (the key readable by the pod's group only), else 0444.
    defaultMode: {{ ternary 288 292 (not (empty $group)) }}
{{- end }}
{{- if $t.caBundle }}
- name: tls-ca
  configMap:
    name: {{ include "bapo.fullname" $r }}-ca-bundle
{{- end }}
{{- if ne .component "actor" }}
- name: blocklist
  configMap:
    name: {{ include "bapo.fullname" $r }}-blocklist
{{- end }}
{{- end }}
{{- end -}}

{{/*
Probes of a gRPC server (buffer, learner): (dict "root" $ "port" N "probe"
map). Kubelet's native gRPC probe speaks plaintext and presents no client
certificate, so under mutual TLS it could never pass: the probes then GET
/metrics on the plaintext metrics port (as the actors' do), which says the
process is up and its runtime answers, not that gRPC is serving.
*/}}
{{- define "bapo.tls.probe" -}}
{{- if .root.Values.tls.enabled }}
httpGet:
  path: /metrics
  port: metrics
{{- else }}
grpc:
  port: {{ .port }}
{{- end }}
{{ toYaml .probe }}
{{- end -}}
