{{- define "capo.labels" -}}
app.kubernetes.io/name: capo
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}
{{- define "capo.selector" -}}
app.kubernetes.io/name: capo
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
{{- define "capo.excluded" -}}
{{- $list := list "kube-system" .Release.Namespace -}}
{{- range .Values.webhook.excludedNamespaces }}{{- $list = append $list . -}}{{- end -}}
{{- toJson (uniq $list) -}}
{{- end -}}
