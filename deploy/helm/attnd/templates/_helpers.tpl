{{/* The objects' name: the release's (attnd-0, attnd-1, ... are then the pods). */}}
{{- define "attnd.fullname" -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "attnd.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "attnd.labels" -}}
{{ include "attnd.selectorLabels" . }}
app.kubernetes.io/component: attention-server
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "attnd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "attnd.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Whether the Prometheus Operator's objects go in ("true" or nothing): wanted, and the cluster
     serves their API unless force says to install them anyway. NOTES.txt says why not. */}}
{{- define "attnd.installServiceMonitor" -}}
{{- if and .Values.serviceMonitor.enabled (or .Values.serviceMonitor.force (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor")) }}true{{ end -}}
{{- end -}}

{{- define "attnd.installPrometheusRule" -}}
{{- if and .Values.prometheusRule.enabled (or .Values.prometheusRule.force (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/PrometheusRule")) }}true{{ end -}}
{{- end -}}

{{/* A byte count for a flag: "all", or the number as digits. Helm reads values.yaml's numbers as
     floats and would print 68719476736 as 6.8719476736e+10, which attnd refuses. */}}
{{- define "attnd.bytes" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ . | int64 }}{{ end -}}
{{- end -}}

{{/* The name TLS clients (probes, drains) verify. */}}
{{- define "attnd.serverName" -}}
{{- default (include "attnd.fullname" .) .Values.tls.serverName -}}
{{- end -}}

{{/* attnctl's TLS flags, as shell words, for the pod's own probes and NOTES.txt: it verifies the
     server name with the Secret's CA and, under mTLS, presents the pod's certificate. */}}
{{- define "attnd.attnctlTLSArgs" -}}
--tls-ca=/etc/attnd/tls/ca.crt --tls-server-name={{ include "attnd.serverName" . }}
{{- if .Values.tls.clientAuth }} --tls-cert=/etc/attnd/tls/tls.crt --tls-key=/etc/attnd/tls/tls.key{{ end }}
{{- end -}}

{{/* The same flags as quoted YAML flow-list items. */}}
{{- define "attnd.attnctlTLS" -}}
"{{ include "attnd.attnctlTLSArgs" . | replace " " "\", \"" }}"
{{- end -}}

{{/* auth.mode none: the Secret holding the token the pods present to each other. */}}
{{- define "attnd.peerTokenSecret" -}}
{{- default (printf "%s-peer-token" (include "attnd.fullname" .)) .Values.auth.peerTokenSecret -}}
{{- end -}}

{{/* The chart's peer token, base64: the one the Secret already holds (upgrades keep it), else a
new random one. */}}
{{- define "attnd.peerToken" -}}
{{- with lookup "v1" "Secret" .Release.Namespace (include "attnd.peerTokenSecret" .) -}}
{{- index .data "token" -}}
{{- else -}}
{{- randAlphaNum 48 | b64enc -}}
{{- end -}}
{{- end -}}
